"""jaxring's runtime set-up helpers."""


def test_use_cpu_devices_replaces_the_device_count(script):
    res = script(
        """
        import jaxring
        jaxring.use_cpu_devices(3)
        import jax
        print(len(jax.devices()))
        try:
            jaxring.use_cpu_devices(0)
        except ValueError as e:
            print("ValueError", e)
    """,
        devices=8,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[0] == "3", res.stdout
    assert "ValueError jaxring.use_cpu_devices: n must be a positive int" in res.stdout


def test_use_cpu_devices_after_jax_started_keeps_its_count_or_says_how_to_fix(script):
    """Once the CPU backend runs its device count is fixed: another count
    raises, naming both fixes, and leaves XLA_FLAGS as it was; the count it
    already has is accepted."""
    res = script(
        """
        import os
        import jaxring
        import jax
        print("devices", len(jax.devices()))
        jaxring.use_cpu_devices(4)
        try:
            jaxring.use_cpu_devices(2)
        except RuntimeError as e:
            print("RuntimeError", " ".join(str(e).split()))
        print("flags", os.environ["XLA_FLAGS"])
    """,
        devices=4,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "devices 4" in out, out
    assert (
        "RuntimeError jaxring.use_cpu_devices(2) was called after JAX started "
        "its backend (with 4 CPU devices)" in out
    ), out
    assert "before the first JAX computation or jax.devices()" in out, out
    assert "set XLA_FLAGS=--xla_force_host_platform_device_count=2 before starting Python" in out, (
        out
    )
    assert "flags --xla_force_host_platform_device_count=4" in out, out


def test_the_rest_of_the_program_runs_inside_a_transport_completion(script):
    """Completing an allreduce runs XLA's continuation on the transport
    thread: here the host callback on its result. So XLA code can run on
    jaxring's threads after Python has the results it waited for, and
    jaxring's exit handler waits for those threads (wait_for_completions)
    before JAX destroys the CPU client under them. (Not every time: where the
    result is ready before XLA waits for it, XLA continues on its own
    thread, so the test asks for most callbacks, not all.)"""
    res = script(
        """
        import jaxring
        import jax, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from jaxring import _jaxring
        inside = []

        def callback(v):
            inside.append(_jaxring.wait_for_completions(0.0))
            return v

        def step(v):
            r = jaxring.allreduce(v, "i")
            return jax.pure_callback(callback, jax.ShapeDtypeStruct(r.shape, r.dtype), r)

        mesh = Mesh(np.array(jax.devices()), ("i",))
        f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("i"),
                                  out_specs=P("i"), check_vma=False))
        x = jax.device_put(np.ones((2, 4), np.float32), NamedSharding(mesh, P("i")))
        for _ in range(10):
            assert float(np.asarray(f(x))[0, 0]) == 2.0
        # wait_for_completions(0.0) is False while a thread is completing.
        print("callbacks", len(inside), "inside a completion", inside.count(False))
        print("after", _jaxring.wait_for_completions(10.0))
    """,
        devices=2,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    words = res.stdout.split()
    callbacks, inside = int(words[1]), int(words[5])
    assert callbacks == 20 and inside >= callbacks // 2, res.stdout
    assert "after True" in res.stdout, res.stdout
    assert "still completing" not in res.stderr, res.stderr[-3000:]
