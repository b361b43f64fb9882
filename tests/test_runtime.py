"""jaxring's runtime set-up helpers."""


def test_use_cpu_devices_replaces_the_device_count(script):
    res = script("""
        import jaxring
        jaxring.use_cpu_devices(3)
        import jax
        print(len(jax.devices()))
        try:
            jaxring.use_cpu_devices(0)
        except ValueError as e:
            print("ValueError", e)
    """, devices=8)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[0] == "3", res.stdout
    assert "ValueError jaxring.use_cpu_devices: n must be a positive int" in res.stdout
