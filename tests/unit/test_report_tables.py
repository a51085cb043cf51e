"""`ray-titan report`'s memory table beyond 16 ranks: ranks sharing a plan collapse to one row."""

from ray_titan.config.units import MiB
from ray_titan.metrics.reading.run_summary import format_memory_table


def _row(rank, predicted, measured=None):
    return {"rank": rank, "coords": f"pp={rank // 4}, dp_shard={rank % 4}", "predicted_bytes": predicted,
            "measured_bytes": measured, "step": 2 if measured else None,
            "error": measured / predicted - 1 if measured else None, "parameters": None, "gradients": None,
            "optimizer_state": None, "activations": None, "temporaries": None, "other": None}


def test_memory_table_collapses_runs_of_ranks_with_the_same_plan_beyond_16_ranks():
    rows = [_row(r, (100 + 10 * (r // 4)) * MiB, measured=150 * MiB if r == 5 else None) for r in range(32)]
    lines = format_memory_table(rows).splitlines()[2:]
    stages = [f"{4 * s}-{4 * s + 3}" for s in range(2, 8)]
    assert [line.split()[0] for line in lines] == ["0-3", "4", "5", "6-7", *stages]
    assert "+36.4%" in lines[2]  # rank 5: measured 150 against 110 MiB
    assert len(format_memory_table(rows[:16]).splitlines()) == 2 + 16  # up to 16 ranks: one row each
