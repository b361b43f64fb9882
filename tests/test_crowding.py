"""The ring count of a crowded job (jaxring/_src/crowding.py): the rule on the
records processes publish. The launched job that lowers it is in
test_multiprocess.py."""

import math

from jaxring._src import crowding


def rec(machine, cpus, ranks=1):
    return {"machine": machine, "cpus": crowding.cpu_ranges(cpus), "ranks": ranks}


def test_cpu_ranges_are_short_and_read_back():
    assert crowding.cpu_ranges(range(64)) == "0-63"
    assert crowding.cpu_ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    for cpus in ([0], [3, 9], list(range(0, 200, 2)), list(range(8192))):
        assert crowding.parse_cpu_ranges(crowding.cpu_ranges(cpus)) == set(cpus)
    for bad in ("", "3-1", "0-8192", "a", "1,,2", "-1", "0-3 ", 7, None, "1" * 70000):
        assert crowding.parse_cpu_ranges(bad) is None, bad


def test_cores_per_rank_is_the_union_of_a_machines_cpus_over_its_ranks():
    # Two processes bound to a core each, or both free on the same two: 1.
    assert crowding.cores_per_rank([rec("a", [0]), rec("a", [1])]) == 1
    assert crowding.cores_per_rank([rec("a", [0, 1]), rec("a", [0, 1])]) == 1
    # Devices count as ranks.
    assert crowding.cores_per_rank([rec("a", range(8), 2), rec("a", range(8), 2)]) == 2
    # The most crowded machine decides.
    assert crowding.cores_per_rank([rec("a", range(64)), rec("b", range(64)), rec("b", [3])]) == 32
    assert crowding.cores_per_rank([rec("a", range(64)), rec("b", [0]), rec("b", [0])]) == 0.5


def test_records_without_the_fields_count_as_machines_with_cores_to_spare():
    assert crowding.cores_per_rank([]) == math.inf
    assert crowding.cores_per_rank([rec("a", [0]), {"address": "h:1"}]) == math.inf
    for bad in (
        {"cpus": [0, 1]},
        {"cpus": "0-99999"},
        {"ranks": 0},
        {"ranks": True},
        {"machine": 7},
    ):
        assert crowding.cores_per_rank([{**rec("a", [0]), **bad}]) == math.inf, bad


def test_one_ring_below_two_cores_per_rank_else_the_configured_count():
    assert crowding.rings_for(2, 1.0) == 1
    assert crowding.rings_for(4, 1.99) == 1
    assert crowding.rings_for(2, 2.0) == 2
    assert crowding.rings_for(3, math.inf) == 3


def test_the_local_record_names_this_machine_its_cpus_and_its_ranks():
    import os

    r = crowding.local_record(3)
    assert r["machine"] == crowding.machine_identity() and r["ranks"] == 3
    assert crowding.parse_cpu_ranges(r["cpus"]) == os.sched_getaffinity(0)
    assert crowding.cores_per_rank([r]) == len(os.sched_getaffinity(0)) / 3
