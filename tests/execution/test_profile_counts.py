"""A node's own counts (RunContext.count) on its profile row: kept per row, summed over an ephemeral node's runs."""
from __future__ import annotations

from execution.profile import ProfileRows


def test_counts_stay_on_their_row_and_add_up_over_copies():
    rows = ProfileRows()
    first = rows.add("5", "KSampler", "5", False, 10.0, 5.0, 0, 1, 1)
    rows.add_counts(first, {"steps_skipped": 3, "steps_computed": 7})
    rows.add("6", "VAEDecode", "6", False, 1.0, 1.0, 0, 1, 1)
    for skipped in (2, 4):  # two loop iterations of one sampler copy add up under one row
        index = rows.add_up("9:KSampler", "KSampler", "9", 1.0, 1.0, 0, 1, 1)
        rows.add_counts(index, {"steps_skipped": skipped})
    table = rows.as_dicts()
    assert table["5"]["counts"] == {"steps_skipped": 3, "steps_computed": 7}
    assert "counts" not in table["6"]
    assert table["9:KSampler"]["counts"] == {"steps_skipped": 6} and table["9:KSampler"]["runs"] == 2
