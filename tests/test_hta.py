"""HolisticTraceAnalysis reads the per-rank timelines of a real DDP fit (one file per rank per directory)."""

import os
import shutil

from hta import trace_analysis as hta

from tests.test_ddp import ddp_run  # noqa: F401  (the 2-process fit, shared with the DDP tests)


def test_trace_analysis_loads_both_ranks_and_their_steps(ddp_run, tmp_path):  # noqa: F811
    for rank in (0, 1):
        shutil.copy(ddp_run / "all" / f"timeline-4-rank{rank}.json", tmp_path / f"rank-{rank}.json")
    analysis = hta.TraceAnalysis(trace_dir=str(tmp_path))
    assert sorted(analysis.t.get_ranks()) == [0, 1]
    for rank in (0, 1):
        frame = analysis.t.get_trace(rank)
        names = set(analysis.t.symbol_table.sym_table[i] for i in frame["name"].unique())
        assert {"aten::addmm", "aten::relu", "ProfilerStep#4"} <= names
        assert (frame["iteration"] == 4).sum() > 50  # HTA found the step and put the ops in it
    assert sorted(os.listdir(tmp_path)) == ["rank-0.json", "rank-1.json"]  # nothing written beside the inputs
