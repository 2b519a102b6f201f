"""How close a step comes to the GPU's limit: `headroom_gb` in the telemetry and the summary, and the one warning."""

from longdpo.training import callbacks


def test_a_step_within_five_percent_of_the_card_or_with_allocator_retries_is_named():
    # an H100 reports 85.0 GB (79.2 GiB): 5% is 4.25 GB
    assert callbacks.near_the_limit(3, 85.0, 80.0, 0) is None
    close = callbacks.near_the_limit(3, 85.0, 81.0, 0)
    assert close.startswith("step 3 reserved 81.0 GB of the GPU's 85.0 GB (4.0 GB left)")
    assert "launch/plan_memory.py" in close and "data.max_length" in close
    retried = callbacks.near_the_limit(7, 85.0, 60.0, 2)
    assert "(25.0 GB left; the allocator freed its cache and retried 2 time(s))" in retried


def test_the_summary_gives_the_smallest_headroom_of_the_steady_steps(tmp_path):
    records = [
        {
            "step": s,
            "peak_allocated_gb": 50.0,
            "peak_reserved_gb": r,
            "gpu_limit_gb": 85.0,
            "headroom_gb": 85.0 - r,
            "host_rss_gb": 3.0,
        }
        for s, r in ((1, 84.0), (2, 70.0), (3, 72.5), (4, 71.0))
    ]
    callbacks.write_summary(records, str(tmp_path))
    table = (tmp_path / "memory_summary.md").read_text().splitlines()
    header, row = table[2].split(" | "), table[4].split(" | ")
    assert row[header.index("Headroom (GB)")] == "12.50"  # step 1 (warm-up) is not the steady state
