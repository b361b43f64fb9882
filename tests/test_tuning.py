"""The autotuner: fitting the model, choosing, the table's file, and
jaxring.allreduce taking its defaults from the table."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from reports import of_kind, reports_by_rank

import jaxring
from jaxring._src import tuning
from jaxring._src.tuning import Candidate, Params

TRUE = Params(
    call_s=3e-4,
    alpha_s=2e-5,
    beta_s_per_byte=4e-10,
    gamma_s_per_byte=1e-10,
    direct_call_s=2e-4,
    direct_s_per_byte=3e-10,
)
SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]


def test_fit_recovers_the_parameters_of_model_generated_times():
    choices = tuning.candidates(8, in_one_process=True)
    measured = [(c, n, tuning.predict(TRUE, c, 8, n)) for c in choices for n in SIZES]
    got = tuning.fit(measured, 8, TRUE.gamma_s_per_byte)
    for name, want in vars(TRUE).items():
        assert getattr(got, name) == pytest.approx(want, rel=1e-6), name


# Two tiers: 2 ranks in each group of a fast tier, 2 groups on a slow one
# whose link the 2 ranks of a group share.
DIMS = (2, 2)
TRUE_TIERED = Params(
    call_s=3e-4,
    alpha_s=1e-4,
    beta_s_per_byte=8e-9,
    gamma_s_per_byte=1e-10,
    direct_call_s=0.0,
    direct_s_per_byte=0.0,
    tiers=((2, 2e-5, 5e-10, 1), (2, 1e-4, 8e-9, 2)),
)


def test_fit_recovers_each_tiers_parameters_from_flat_and_tiered_times():
    choices = tuning.candidates(4, in_one_process=False, tiered=True)
    assert {c.topology for c in choices} == {"flat", "auto"}
    assert [c for c in choices if c.algorithm != "ring"] == [Candidate("exchange", 1, 1 << 20)]
    measured = [(c, n, tuning.predict(TRUE_TIERED, c, 4, n)) for c in choices for n in SIZES]
    got = tuning.fit(measured, 4, TRUE_TIERED.gamma_s_per_byte, DIMS)
    assert got.call_s == pytest.approx(TRUE_TIERED.call_s, rel=1e-6)
    assert len(got.tiers) == 2
    for g, w in zip(got.tiers, TRUE_TIERED.tiers):
        assert g[0] == w[0] and g[3] == w[3]
        assert g[1:3] == pytest.approx(w[1:3], rel=1e-6)
    # The flat ring runs at the pace of the slow tier and sends 1.5 n over
    # each group's link; the tiered plan n: tiered wins for large messages.
    big = tuning.select(got, choices, 4, [64 << 20])[64 << 20]
    assert big.topology == "auto"
    flat = min(
        (c for c in choices if c.topology == "flat"),
        key=lambda c: tuning.predict(got, c, 4, 64 << 20),
    )
    assert tuning.predict(got, flat, 4, 64 << 20) > 1.3 * tuning.predict(got, big, 4, 64 << 20)


def test_direct_is_measured_across_processes_that_share_the_host_segment():
    """Across the processes of one host that share the host segment, direct
    is a candidate beside the ring and the exchange, with one device per
    process or several (where it competes with the tiered plan, as "auto"
    runs it in its place); its rows fit its own two parameters, and it is
    chosen where it is fastest."""
    assert not any(c.algorithm == "direct" for c in tuning.candidates(4, False))
    tiered = tuning.candidates(4, in_one_process=False, tiered=True, host_direct=True)
    assert Candidate("direct", 2, 1 << 20) in tiered
    assert any(c.topology == "auto" for c in tiered)  # the tiered plan too
    choices = tuning.candidates(4, in_one_process=False, host_direct=True)
    assert [c for c in choices if c.algorithm != "ring"] == [
        Candidate("direct", 2, 1 << 20),
        Candidate("exchange", 1, 1 << 20),
    ]
    true = dataclasses.replace(TRUE, direct_call_s=1e-4, direct_s_per_byte=1e-9)
    measured = [(c, n, tuning.predict(true, c, 4, n)) for c in choices for n in SIZES]
    got = tuning.fit(measured, 4, true.gamma_s_per_byte)
    assert got.direct_call_s == pytest.approx(1e-4, rel=1e-6)
    assert got.direct_s_per_byte == pytest.approx(1e-9, rel=1e-6)
    picked = tuning.select(got, choices, 4, SIZES)
    for n in SIZES:
        best = min(choices, key=lambda c: tuning.predict(true, c, 4, n))
        assert picked[n] == best, n
    assert picked[4 << 10].algorithm == "direct"


@pytest.mark.parametrize(
    "direct_call_s, direct_s_per_byte, kept", [(2e-4, 2e-9, "no direct"), (1e-5, 1e-9, "direct")]
)
def test_across_processes_of_one_host_a_table_takes_direct_everywhere_or_nowhere(
    direct_call_s, direct_s_per_byte, kept
):
    """Direct sends no frames: processes at one call site with different
    shapes, one in direct and one in the ring, would wait for each other
    until the timeout. So where the processes share the host segment the
    table keeps direct at every size or at none: the family whose choices
    lose least to the fastest, summed over the sizes as ratios."""
    choices = tuning.candidates(4, in_one_process=False, host_direct=True)
    # Cheaper calls, dearer bytes: direct is fastest at the small sizes only.
    params = dataclasses.replace(
        TRUE, direct_call_s=direct_call_s, direct_s_per_byte=direct_s_per_byte
    )
    mixed = tuning.select(params, choices, 4, SIZES)
    assert {c.algorithm == "direct" for c in mixed.values()} == {True, False}
    one = tuning.select(params, choices, 4, SIZES, direct_everywhere_or_nowhere=True)
    assert {"direct" if c.algorithm == "direct" else "no direct" for c in one.values()} == {kept}

    def loss(family):
        return sum(
            min(tuning.predict(params, c, 4, n) for c in family)
            / tuning.predict(params, mixed[n], 4, n)
            for n in SIZES
        )

    direct = [c for c in choices if c.algorithm == "direct"]
    rest = [c for c in choices if c.algorithm != "direct"]
    assert (loss(direct) <= loss(rest)) == (kept == "direct")
    # Each size takes the fastest of the family kept.
    family = direct if kept == "direct" else rest
    assert one == tuning.select(params, family, 4, SIZES)
    # Without the segment (or in one process) the table keeps the fastest.
    assert tuning.select(params, choices, 4, SIZES) == mixed


def test_exchange_is_measured_across_processes_and_wins_where_steps_cost_most():
    """The exchange is a candidate where direct is not (ranks in several
    processes) and differs from the ring (a factor 2 in the world size);
    its rows fit the same parameters, and the choice follows the link:
    the exchange for small messages on a slow, high-latency network, the
    ring for large ones."""
    assert not any(c.algorithm == "exchange" for c in tuning.candidates(8, True))
    assert not any(c.algorithm == "exchange" for c in tuning.candidates(3, False))
    choices = tuning.candidates(8, in_one_process=False)
    assert Candidate("exchange", 1, 1 << 20) in choices
    slow = dataclasses.replace(TRUE, alpha_s=5e-4, beta_s_per_byte=2e-7)
    sizes = [256, 1 << 10, 4 << 10, 64 << 10]
    measured = [(c, n, tuning.predict(slow, c, 8, n)) for c in choices for n in sizes]
    got = tuning.fit(measured, 8, slow.gamma_s_per_byte)
    assert (got.alpha_s, got.beta_s_per_byte) == pytest.approx(
        (slow.alpha_s, slow.beta_s_per_byte), rel=1e-6
    )
    picked = tuning.select(got, choices, 8, sizes)
    assert picked[256].algorithm == "exchange"
    assert picked[64 << 10].algorithm == "ring"
    # Where latency is cheap the ring's fewer bytes win already at 4 KiB.
    fast = dataclasses.replace(TRUE, alpha_s=1e-7)
    assert tuning.select(fast, choices, 8, [4 << 10])[4 << 10].algorithm == "ring"


def test_tier_link_sharing_is_the_product_of_the_tighter_tiers():
    assert tuning.shared_links((4, 2, 8)) == (1, 4, 8)
    assert tuning.shared_links((2,)) == (1,)


def test_fit_keeps_parameters_non_negative():
    # Times that fall with size would need a negative beta.
    c = Candidate("ring", 1, 1 << 20)
    measured = [(c, n, 1e-3 - n * 1e-12) for n in SIZES]
    got = tuning.fit(measured, 4, 0.0)
    assert min(got.call_s, got.alpha_s, got.beta_s_per_byte) >= 0


def test_select_takes_the_fastest_prediction_and_lookup_the_next_size():
    choices = tuning.candidates(8, in_one_process=True)
    sel = tuning.select(TRUE, choices, 8, SIZES)
    for n, c in sel.items():
        assert tuning.predict(TRUE, c, 8, n) == min(tuning.predict(TRUE, x, 8, n) for x in choices)
    # Predictions within TIE of each other: the measurement decides.
    a, b = Candidate("ring", 1, 1 << 20, "auto"), Candidate("ring", 2, 1 << 20, "auto")
    tied = dataclasses.replace(TRUE_TIERED, tiers=((2, 0.0, 5e-10, 1), (2, 0.0, 8e-9, 2)))
    assert tuning.predict(tied, a, 4, 1 << 24) == pytest.approx(tuning.predict(tied, b, 4, 1 << 24))
    assert tuning.select(tied, [a, b], 4, [1 << 24])[1 << 24] == a
    assert (
        tuning.select(tied, [a, b], 4, [1 << 24], [(a, 1 << 24, 0.2), (b, 1 << 24, 0.1)])[1 << 24]
        == b
    )
    # Outside the tie, the model's choice stands whatever was measured.
    slow = Candidate("ring", 2, 1 << 20, "flat")
    assert (
        tuning.select(tied, [a, slow], 4, [1 << 24], [(a, 1 << 24, 0.2), (slow, 1 << 24, 0.1)])[
            1 << 24
        ]
        == a
    )
    entry = {
        "choices": {
            "1024": vars(Candidate("ring", 1, 4096)),
            "65536": vars(Candidate("direct", 2, 1 << 20)),
        }
    }
    assert tuning.lookup(entry, 10) == Candidate("ring", 1, 4096)
    assert tuning.lookup(entry, 1024) == Candidate("ring", 1, 4096)
    assert tuning.lookup(entry, 1025) == Candidate("direct", 2, 1 << 20)
    assert tuning.lookup(entry, 1 << 30) == Candidate("direct", 2, 1 << 20)


def test_a_table_that_mixes_direct_with_the_ring_is_not_used_across_processes(tmp_path):
    """Tables written before the tuner kept direct at every size or at none
    may mix them by size; across processes such a table would let processes
    that reach one allreduce with different shapes wait for each other until
    the timeout, so it is left unused, with one warning. In one process, or
    with one family, it is used."""
    path = str(tmp_path / "t.json")
    mixed = {4096: Candidate("direct", 2, 1 << 20), 1 << 20: Candidate("ring", 2, 1 << 18)}
    tuning.save(path, "cpu/ranks=4/processes=4", tuning.entry(TRUE, mixed))
    tuning.save(path, "cpu/ranks=4/processes=1", tuning.entry(TRUE, mixed))
    rings_only = {4096: Candidate("exchange", 1, 1 << 20), 1 << 20: Candidate("ring", 2, 1 << 18)}
    tuning.save(path, "cpu/ranks=8/processes=4", tuning.entry(TRUE, rings_only))
    assert tuning.mixes_direct(tuning.load(path)["cpu/ranks=4/processes=4"])
    assert not tuning.mixes_direct(tuning.load(path)["cpu/ranks=8/processes=4"])
    tuning._warned_mixed.clear()
    with pytest.warns(UserWarning, match="takes direct at some sizes") as caught:
        for nbytes in (100, 1 << 20):
            assert (
                tuning.tuned_choice(path, "cpu/ranks=4/processes=4", nbytes, across_processes=True)
                is None
            )
    assert len(caught) == 1
    assert tuning.tuned_choice(path, "cpu/ranks=4/processes=1", 100) == mixed[4096]
    assert (
        tuning.tuned_choice(path, "cpu/ranks=8/processes=4", 1 << 20, across_processes=True)
        == rings_only[1 << 20]
    )


def test_file_round_trip_keeps_other_topologies(tmp_path):
    path = str(tmp_path / "t.json")
    sel = {4096: Candidate("ring", 3, 12345)}
    tuning.save(path, "cpu/ranks=4/processes=1", tuning.entry(TRUE, sel))
    tuning.save(path, "cpu/ranks=8/processes=1", tuning.entry(TRUE, sel))
    tables = tuning.load(path)
    assert sorted(tables) == ["cpu/ranks=4/processes=1", "cpu/ranks=8/processes=1"]
    assert Params.from_dict(tables["cpu/ranks=4/processes=1"]["params"]) == TRUE
    assert tuning.tuned_choice(path, "cpu/ranks=4/processes=1", 100) == Candidate("ring", 3, 12345)
    assert tuning.tuned_choice(path, "cpu/ranks=2/processes=1", 100) is None
    assert tuning.tuned_choice("off", "cpu/ranks=4/processes=1", 100) is None
    with pytest.raises(FileNotFoundError, match="no tuning file at"):
        tuning.tuned_choice(str(tmp_path / "missing.json"), "k", 1)
    (tmp_path / "old.json").write_text(json.dumps({"version": 0, "tables": {}}))
    with pytest.raises(ValueError, match="not a jaxring tuning file of version"):
        tuning.load(str(tmp_path / "old.json"))


def _attrs(text):
    m = re.search(r"custom_call @jaxring_allreduce_cpu\(.*?\) \{(.*?)\}", text, re.S)
    body = m.group(1)
    return {
        k: int(re.search(rf"{k} = (\d+)", body).group(1))
        for k in ("num_rings", "chunk_bytes", "algorithm")
    }


def test_allreduce_takes_unset_settings_from_the_table(tmp_path):
    path = str(tmp_path / "t.json")
    key = tuning.key("cpu", 4, 1)
    tuning.save(
        path,
        key,
        tuning.entry(
            TRUE, {1024: Candidate("ring", 3, 12345), 1 << 20: Candidate("direct", 2, 1 << 16)}
        ),
    )
    mesh = jax.make_mesh((4,), ("i",), devices=jax.devices()[:4])

    def lowered(count, **kw):
        x = jax.device_put(np.ones(4 * count, np.float32), NamedSharding(mesh, P("i")))
        f = jax.jit(
            jax.shard_map(
                lambda v: jaxring.allreduce(v, "i", **kw),
                mesh=mesh,
                in_specs=P("i"),
                out_specs=P("i"),
                check_vma=False,
            )
        )
        return _attrs(f.lower(x).as_text())

    default = lowered(16)
    jaxring.config.update("tuning", path)
    try:
        # 64 bytes: the 1 KiB entry; 64 KiB: the 1 MiB entry (direct).
        assert lowered(16) == {"num_rings": 3, "chunk_bytes": 12345, "algorithm": 0}
        assert lowered(16384) == {"num_rings": 2, "chunk_bytes": 1 << 16, "algorithm": 1}
        # What is given wins over the table.
        assert lowered(16, rings=2)["num_rings"] == 2
        jaxring.config.update("chunk_bytes", 4096)
        assert lowered(16)["chunk_bytes"] == 4096
        assert lowered(16)["num_rings"] == 3
    finally:
        jaxring.config.reset("tuning")
        jaxring.config.reset("chunk_bytes")
    assert lowered(16) == default


def test_table_fills_in_the_topology_unless_it_was_set(tmp_path):
    from jaxring._src.choice import tuned_settings

    path = str(tmp_path / "t.json")
    tuning.save(
        path,
        tuning.key("cpu", 4, 1),
        tuning.entry(
            TRUE,
            {
                1024: Candidate("ring", 3, 12345, "auto"),
                1 << 20: Candidate("ring", 1, 4096, "flat"),
            },
        ),
    )
    everything = {"rings", "chunk_bytes", "algorithm", "topology"}
    jaxring.config.update("tuning", path)
    try:
        assert tuned_settings(everything, 4, 100, 2, 1 << 20, "auto", "flat") == (
            3,
            12345,
            "ring",
            "auto",
            True,
        )
        assert tuned_settings(everything, 4, 1 << 19, 2, 1 << 20, "auto", "auto") == (
            1,
            4096,
            "ring",
            "flat",
            True,
        )
        # No entry for 8 ranks: the settings stay, and say they were not tabled.
        assert tuned_settings(everything, 8, 100, 2, 1 << 20, "auto", "auto") == (
            2,
            1 << 20,
            "auto",
            "auto",
            False,
        )
        # A topology that was given stays.
        assert tuned_settings(everything - {"topology"}, 4, 100, 2, 1 << 20, "auto", (2, 2))[3] == (
            2,
            2,
        )
        # An algorithm given as "auto" keeps "auto"'s topology too: the
        # table's "flat" at some sizes and "auto" at others would run the
        # ring at some and direct at others across processes of one host.
        # Given as "ring", the table still picks flat or tiered.
        assert tuned_settings(
            everything - {"algorithm"}, 4, 1 << 19, 2, 1 << 20, "auto", "auto"
        ) == (1, 4096, "auto", "auto", True)
        assert tuned_settings(
            everything - {"algorithm"}, 4, 1 << 19, 2, 1 << 20, "ring", "auto"
        ) == (1, 4096, "ring", "flat", True)
    finally:
        jaxring.config.reset("tuning")
    # The table's exchange runs where the topology is the table's too; a
    # topology that was given asks for the ring plan, as it does of "auto".
    tuning.save(
        path, tuning.key("cpu", 4, 1), tuning.entry(TRUE, {1024: Candidate("exchange", 1, 1 << 20)})
    )
    tuning._loaded.clear()
    jaxring.config.update("tuning", path)
    try:
        assert tuned_settings(everything, 4, 100, 2, 4096, "auto", "auto") == (
            1,
            1 << 20,
            "exchange",
            "flat",
            True,
        )
        for given in ((2, 2), "flat"):
            assert tuned_settings(everything - {"topology"}, 4, 100, 2, 4096, "auto", given)[
                2:4
            ] == ("ring", given)
    finally:
        jaxring.config.reset("tuning")
    # A table entry whose topology is neither "flat" nor "auto" is refused.
    tuning.save(
        path,
        tuning.key("cpu", 4, 1),
        tuning.entry(TRUE, {1024: Candidate("ring", 3, 12345, "2x2")}),
    )
    tuning._loaded.clear()
    jaxring.config.update("tuning", path)
    try:
        with pytest.raises(ValueError, match="jaxring tuning table: topology must be"):
            tuned_settings(everything, 4, 100, 2, 1 << 20, "auto", "auto")
    finally:
        jaxring.config.reset("tuning")


@pytest.mark.jax_independent  # the command's measuring loop
def test_tune_command_measures_fits_and_writes_a_table(tmp_path):
    out = tmp_path / "tuning.json"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxring.tune",
            "--devices",
            "2",
            "--min-bytes",
            "4K",
            "--max-bytes",
            "16K",
            "--quick",
            "--rounds",
            "1",
            "--min-time",
            "0.02",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "prediction error: median" in res.stdout
    assert "model's choice:" in res.stdout
    tables = tuning.load(str(out))
    assert sorted(tables["cpu/ranks=2/processes=1"]["choices"]) == ["16384", "4096"]
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxring.tune",
            "--devices",
            "2",
            "--max-bytes",
            "16K",
            "--load",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "predicted" in res.stdout and "16 KiB" in res.stdout


@pytest.mark.multiprocess
@pytest.mark.jax_independent  # processes and plans
def test_tune_across_processes_measures_both_plans_and_the_job_uses_its_table(tmp_path):
    """Under the launcher (2 processes x 2 devices, one host: tiers 2x2) the
    tuner measures flat, tiered, exchange and direct candidates (direct
    over the host segment, which "auto" runs there), fits a tier each, and
    writes one table; a job then lowers what the table says: the exchange,
    or the ring flat or tiered."""
    out = tmp_path / "tuning.json"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxring.launch",
            "-n",
            "2",
            "--devices-per-process",
            "2",
            "-m",
            "jaxring.tune",
            "--quick",
            "--min-bytes",
            "4K",
            "--max-bytes",
            "16K",
            "--rounds",
            "1",
            "--min-time",
            "0.02",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "[0] # 4 devices in 2 processes, tiers 2x2" in res.stdout
    assert "tiered r=1" in res.stdout and "ring r=1" in res.stdout
    assert "  exchange " in res.stdout and "  direct " in res.stdout
    assert "[1] # model" not in res.stdout  # process 0 reports
    tables = tuning.load(str(out))
    entry = tables["cpu/ranks=4/processes=2"]
    params = Params.from_dict(entry["params"])
    assert [(t[0], t[3]) for t in params.tiers] == [(2, 1), (2, 2)]
    assert sorted(entry["choices"]) == ["16384", "4096"]
    # Make the sizes differ in algorithm, plan and rings, so every path is
    # seen: the exchange, and the ring tiered.
    entry["choices"]["4096"].update(algorithm="exchange", topology="flat", rings=2)
    entry["choices"]["16384"].update(algorithm="ring", topology="auto", rings=1)
    tuning.save(str(out), "cpu/ranks=4/processes=2", entry)
    script = Path(__file__).parent / "multiprocess" / "tuned_lowering.py"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxring.launch",
            "-n",
            "2",
            "--devices-per-process",
            "2",
            str(script),
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    by_rank = reports_by_rank(res.stdout)
    assert sorted(by_rank) == [0, 1], res.stdout
    choices = [c for rank in (0, 1) for c in of_kind(by_rank[rank], "choice")]
    assert len(choices) == 4, res.stdout
    for c in choices:
        assert c["table"] == c["lowered"], c
    assert {c["lowered"][3] for c in choices} == {"flat", "auto"}
    assert any(c["lowered"][0] == "exchange" for c in choices)
    assert all(len(of_kind(by_rank[rank], "done")) == 1 for rank in (0, 1)), res.stdout
