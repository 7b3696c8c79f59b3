"""bench/fused_ablate.py's CPU half: its ablations are text edits of kernels/fused_sm90.py, so each must still find
what it cuts in the current kernel and leave valid Python that lacks exactly that; and bench/timing.py's
alternating timer and hang guard, with torch.cuda's events replaced by a clock that records what ran when."""
import ast
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
_spec = importlib.util.spec_from_file_location("fused_ablate", REPO / "bench" / "fused_ablate.py")
fused_ablate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fused_ablate)
import timing  # noqa: E402  (bench/, put on the path above)

KERNEL = (REPO / "kernels" / "fused_sm90.py").read_text()


def _function(source, name):
    """The source text of top-level function `name`."""
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.get_source_segment(source, node)


@pytest.mark.parametrize("name", sorted(fused_ablate.VARIANTS))
def test_every_ablation_applies_to_the_kernel(name):
    edited = fused_ablate.VARIANTS[name](KERNEL)
    ast.parse(edited)
    if name in ("fused", "fused_copy"):
        assert edited == KERNEL
    else:
        assert len(edited) < len(KERNEL)


def test_unsynced_drops_only_the_two_terms_waits():
    edited = fused_ablate.VARIANTS["unsynced"](KERNEL)
    for partition, wait in (("_state_partition", "terms.bars.wait_ready(c)"),
                            ("_aux_partition", fused_ablate.CLAIM_TERMS_SLOT.strip())):
        assert wait in _function(KERNEL, partition)
        assert wait not in _function(edited, partition)
        # everything else in the loop is still there: the products, the releases and publications
        assert (_function(edited, partition).count("warpgroup_mma(")
                == _function(KERNEL, partition).count("warpgroup_mma("))
    assert KERNEL.replace("        terms.bars.wait_ready(c)\n", "", 1) \
        .replace("        " + fused_ablate.CLAIM_TERMS_SLOT + "        gam_r", "        gam_r", 1) == edited


def test_stubs_remove_their_partition_s_products():
    aux = _function(fused_ablate.VARIANTS["aux_stub"](KERNEL), "_aux_partition")
    assert "warpgroup_mma(" not in aux and "_hand_over_terms(terms, c, exchange)" in aux
    state = _function(fused_ablate.VARIANTS["state_stub"](KERNEL), "_state_partition")
    assert "warpgroup_mma(" not in state and "inputs.bars.release(c)" in state


def test_state_chain_keeps_only_the_recurrence():
    edited = fused_ablate.VARIANTS["state_chain"](KERNEL)
    assert "warpgroup_mma(" not in _function(edited, "_aux_partition")
    state = _function(edited, "_state_partition")
    # S k^T, v_new and the update stay; S q^T, the output product and o's staging and store go
    assert state.count("warpgroup_mma(") == 3 and "qh" not in state
    assert "o_stage.store(" not in state and "tma.async_copy_shared_to_global" not in state
    assert "inputs.bars.release(c)" in state and "terms.rq_bars.wait_ready(c)" in state


class _Clock:
    """Stand-in for torch.cuda: Event.record() reads a clock that each timed call advances by its own cost."""

    def __init__(self):
        self.now = 0.0
        self.calls = []

    def event(self, enable_timing=False):
        clock = self

        class Event:
            def record(self):
                self.at = clock.now

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return end.at - self.at

        return Event()


def test_timed_alternating_alternates_and_takes_medians(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(timing.torch.cuda, "Event", clock.event)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)

    def make(i, cost):
        def fn():
            clock.calls.append(i)
            # drift: every call gets slower, so a fn timed in one block after another would look slower
            clock.now += cost + 0.001 * len(clock.calls)
        return fn

    medians = timing.timed_alternating([make(0, 1.0), make(1, 1.0), make(2, 2.0)], reps=4, warmup=1)
    assert clock.calls == [0, 1, 2, 0, 1, 2, 2, 1, 0, 0, 1, 2, 2, 1, 0]
    # equal costs come out equal: each fn's median is over calls spread alike across the run
    assert medians[0] == pytest.approx(medians[1])
    assert medians[2] == pytest.approx(medians[0] + 1.0, abs=0.005)


def test_finish_or_exit_names_a_hung_kernel_and_ends(monkeypatch, capsys):
    """A first launch still running after the limit is reported with what was launched, and the process ends (a
    hung kernel would block every later synchronize); finished work returns at once."""
    class Event:
        done = False

        def record(self):
            pass

        def query(self):
            return Event.done

    now = [0.0]
    monkeypatch.setattr(timing.torch.cuda, "Event", Event)
    monkeypatch.setattr(timing.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(timing.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(timing.os, "_exit", exit_)
    Event.done = True
    timing.finish_or_exit("abA gdn_scan w16 on 1x8192", limit_s=5)
    assert now[0] == 0.0 and capsys.readouterr().out == ""
    Event.done = False
    with pytest.raises(SystemExit) as stop:
        timing.finish_or_exit("abB gdn_scan w16 on 1x8192", limit_s=5)
    assert stop.value.code == 3 and 5.0 < now[0] < 5.1
    assert "abB gdn_scan w16 on 1x8192: still running after 5 s" in capsys.readouterr().out
