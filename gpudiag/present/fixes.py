"""The "Measured fixes" of `gpudiag profile --try-fixes`: report.md's table and the terminal's;
where its re-runs (and a short script's second run) ran, and what they wrote outside."""

from __future__ import annotations

from pathlib import PurePath

from rich.table import Table
from rich.text import Text

from gpudiag.diagnose.ledger import timed_shares
from gpudiag.model.remedies import DIAGNOSIS_RUN, REMEDIES
from gpudiag.model.results import MeasuredFix, Rerun, RunResult
from gpudiag.present.tables import markdown_table

HEADER = ("fix", "answers", "ms/step (mean) before -> after", "speedup (95% CI)",
          "priced vs saved", "J/step", "same result?", "make it permanent")
EQUIVALENCE = {
    "same": "same losses",
    "mixed-precision": "differs as mixed precision does",
    "differs": "DIFFERS",
    "unchecked": "not checked (no loss seen)",
    "recipe": ("another recipe: it trains with a larger batch (scale the learning rate, and "
               "divide the steps, to match)"),
}

UNMEASURED = {"failed": "failed", "not-measured": "not measured"}  # said after the fix's title


def _ms(fix: MeasuredFix) -> str:
    if fix.after_ms is None:
        return "-"
    batches = _batches(fix)
    before = f"{fix.before_ms:,.2f}" if fix.before_ms is not None else "-"
    # A larger batch's step takes longer: the batch beside each says why, not "slower".
    return f"{before} -> {fix.after_ms:,.2f}" + (
        f" (batch {batches[0]:,} -> {batches[1]:,})" if batches else "")


def _batches(fix: MeasuredFix) -> tuple[int, int] | None:
    """A larger batch's training batch without and with it: its speedup is per sample."""
    record = fix.evidence.larger_batch if fix.remedy == "larger-batch" else None
    return record.batches() if record is not None else None


# An interval wider than this ratio (high / low) says nothing: too few or too noisy steps.
UNINFORMATIVE_INTERVAL = 4.0


def _speedup(fix: MeasuredFix) -> str:
    if fix.speedup is None:
        return "-"
    unit = " in samples/s" if _batches(fix) else ""
    if fix.speedup_low is None or fix.speedup_high is None:
        return f"{fix.speedup:.2f}x{unit}"
    interval = _interval(fix)
    if interval is None:
        return f"{fix.speedup:.2f}x{unit} (steps too few or too noisy for an interval)"
    return f"{fix.speedup:.2f}x{unit} ({interval[0]:.2f}-{interval[1]:.2f})"


def _interval(fix: MeasuredFix) -> tuple[float, float] | None:
    """The speedup's interval, where it says something."""
    low, high = fix.speedup_low, fix.speedup_high
    if low is None or high is None or low <= 0 or high / low > UNINFORMATIVE_INTERVAL:
        return None
    return low, high


# Peaks within this share of each other are the same memory: the allocator rounds blocks up
# and caches them (pytorch.org/docs/stable/notes/cuda.html, "Memory management").
MIN_FREED_SHARE = 0.05


def _frees_memory(fix: MeasuredFix) -> bool:
    remedy = REMEDIES.get(fix.remedy)
    return remedy is not None and remedy.frees_memory


def _peak(mib: float | None, oom_step: int | None) -> str:
    if oom_step is not None:
        return f"out of memory at step {oom_step}"
    return f"{mib / 1024:,.2f} GiB" if mib is not None else "-"


def memory_cell(fix: MeasuredFix) -> str:
    """The allocator's peak without and with the fix (or the step a run died at)."""
    before = _peak(fix.before_peak_mib, fix.before_oom_step)
    after = _peak(fix.after_peak_mib, fix.after_oom_step)
    if before == after == "-":
        return "-"
    change = ""
    if fix.before_peak_mib and fix.after_peak_mib is not None and fix.before_oom_step is None \
            and fix.after_oom_step is None:
        change = f" ({fix.after_peak_mib / fix.before_peak_mib - 1:+.0%})"
    return f"{before} -> {after}{change}"


def _freed(fix: MeasuredFix) -> str | None:
    """Why a fix that frees memory did not (None where it did: it ran where the script died
    without it, or its peak fell)."""
    if fix.after_oom_step is not None:
        return f"the script died of out-of-memory with it too (at step {fix.after_oom_step})"
    if fix.before_oom_step is not None:
        return None
    if fix.before_peak_mib is None or fix.after_peak_mib is None:
        return "its memory was not measured (the allocator's peak is read on CUDA)"
    if fix.after_peak_mib > fix.before_peak_mib * (1 - MIN_FREED_SHARE):
        return f"it freed no memory at the peak ({memory_cell(fix)})"
    return None


def _priced(fix: MeasuredFix, price: float | None) -> str:
    """The finding's printed price beside the share of the step the fix saved as measured
    (1 - 1/speedup, with its interval): the price model's error, in view. A fix that frees
    memory: its time cost instead."""
    said = f"priced {price:.0%}" if price is not None else ""
    if fix.status == "measured" and _frees_memory(fix):
        return (f"costs {1 / fix.speedup - 1:+.0%} time" if fix.speedup is not None
                else "time cost not measured")
    if fix.status != "measured" or fix.speedup is None:
        return said or "-"
    # A larger batch saves per sample: not the part of the step the finding priced.
    per = " per sample" if REMEDIES.get(fix.remedy) is not None and \
        REMEDIES[fix.remedy].numerics == "recipe" else ""
    saved = f"saved{per} {1 - 1 / fix.speedup:.0%}"
    interval = _interval(fix)
    if interval is not None:
        saved += f" ({1 - 1 / interval[0]:.0%} to {1 - 1 / interval[1]:.0%})"
    return f"{said}, {saved}" if said else saved


def price_of(fix: MeasuredFix, priced: dict[str, float]) -> float | None:
    """The price of the findings one remedy answers: their sum where the remedy removes each
    of the disjoint parts they price, else the largest (None for several remedies together:
    their prices overlap, or for findings the run did not keep)."""
    if fix.remedy == "combined":
        return None
    shares = [priced[code] for code in fix.findings if code in priced]
    if not shares:
        return None
    remedy = REMEDIES.get(fix.remedy)
    return min(1.0, sum(shares)) if remedy is not None and remedy.adds_prices else max(shares)


def _energy(fix: MeasuredFix) -> str:
    if fix.before_j_per_step is None or fix.after_j_per_step is None:
        return "-"
    batches = _batches(fix)  # a larger batch's step holds more samples: per sample too
    return f"{fix.before_j_per_step:,.2f} -> {fix.after_j_per_step:,.2f}" + (
        f" ({fix.before_j_per_step / batches[0]:,.3g} -> "
        f"{fix.after_j_per_step / batches[1]:,.3g} J/sample)" if batches else "")


def _same(fix: MeasuredFix) -> str:
    if fix.status != "measured":
        return "-"
    if fix.equivalence == "unchecked" and fix.loss_floor is not None:
        return (f"cannot tell: two runs without it differ by {fix.loss_floor:.2%} already "
                "(resumed from a checkpoint, or random data order?)")
    text = EQUIVALENCE[fix.equivalence]
    if fix.loss_gap is not None and fix.equivalence != "same":
        text += f" (gap {fix.loss_gap:.2%}, runs without it {fix.loss_floor or 0:.2%})"
    return text


def _not_recommended(fix: MeasuredFix) -> str | None:
    """Why a measured fix is not to be made permanent: not measured faster (its interval
    reaching 1), or, for one that frees memory, not measured smaller; or its losses changed
    or cannot tell; None when it is to be."""
    if fix.status != "measured" or (fix.speedup is None and not _frees_memory(fix)):
        return None
    if fix.changed_nothing:
        return (f"{fix.note} (the {fix.speedup:.2f}x is noise between two runs)"
                if fix.speedup is not None else fix.note)
    paid = _freed(fix) if _frees_memory(fix) else _not_faster(fix)
    if paid is not None:
        return paid
    if fix.equivalence == "differs":
        return "it changed the losses"
    if fix.equivalence == "unchecked" and fix.loss_floor is not None:
        return "the losses cannot tell whether it computes the same"
    return None  # the same, or no losses seen (the "same result?" column says which)


def _not_faster(fix: MeasuredFix) -> str | None:
    """Why a fix's speedup is no gain: its interval reaches 1 (None where it does not)."""
    assert fix.speedup is not None
    low = fix.speedup_low if fix.speedup_low is not None else fix.speedup
    if low > 1.0:
        return None
    return (f"not measured faster ({_speedup(fix)})" if fix.speedup > 1.0
            else f"measured slower or no faster ({_speedup(fix)})")


def recommended(fix: MeasuredFix) -> bool:
    """To be made permanent: measured, faster (or, where it frees memory, smaller), and its
    losses the same (or not seen)."""
    return fix.status == "measured" and (fix.speedup is not None or _frees_memory(fix)) \
        and _not_recommended(fix) is None


def _change(fix: MeasuredFix) -> str:
    where = f"at `{fix.location}`: " if fix.location else ""
    if fix.status == "no-remedy":  # the finding's own advice, which no run measured
        return f"not measured ({fix.note}); the finding suggests {where}{fix.change}"
    if fix.status == "not-measured":  # a stop came first; the note says so
        return fix.note or "not measured"
    if fix.status != "measured" or (fix.speedup is None and not _frees_memory(fix)):
        # its runs failed: no advice
        return f"not recommended: {fix.note or UNMEASURED.get(fix.status, 'not measured')}"
    why_not = _not_recommended(fix)
    if why_not is not None:
        # A slower fix's note says what the code does instead (the loader's workers).
        slower = fix.speedup is not None and fix.speedup < 1.0 and fix.note \
            and not fix.changed_nothing and not _frees_memory(fix)
        return f"not recommended: {why_not}" + (f"; {fix.note}" if slower else "")
    note = f" ({fix.note})" if fix.note else ""
    if _frees_memory(fix):
        return f"where memory is the limit: {where}{fix.change}{note}"
    return f"{where}{fix.change}{note}"


def fix_cells(fix: MeasuredFix, price: float | None = None) -> list[str]:
    """One row: HEADER's cells, `price` the printed price of the finding it answers."""
    name = f"{fix.title} ({UNMEASURED[fix.status]})" if fix.status in UNMEASURED else fix.title
    return [name, ", ".join(fix.findings) or "-", _ms(fix), _speedup(fix), _priced(fix, price),
            _energy(fix), _same(fix), _change(fix)]


def fixes_markdown(run: RunResult) -> list[str]:
    """report.md's "Measured fixes": ranked by speedup, with the permanent change of each."""
    if not run.fixes:
        return []
    lines = ["## Measured fixes", "",
             "Each fix was applied to the unmodified script for one run (same seed, same "
             "timing window; intervals from blocks of one process a side and the device "
             "kind's between-process spread). A fix is to be made permanent only when it was "
             "measured faster (its interval above 1) and its losses did not change. "
             "`same result?` compares the first steps' losses with the diagnosis run's, against "
             "how much two runs without the fix differ. `priced vs saved`: the finding's "
             "price, as a share of the mean timed step, beside the share of it the fix saved "
             "(1 - 1/speedup)." + (
                 f" A fix that frees memory is judged by the allocator's peak instead: worth "
                 f"making where memory is the limit when its peak fell by {MIN_FREED_SHARE:.0%}"
                 " or more (or the script ran its steps where it died of out-of-memory "
                 "without it), its time is its cost." if any(map(_frees_memory, run.fixes))
                 else ""), ""]
    priced = timed_shares(run)
    rows = [fix_cells(f, price_of(f, priced)) for f in run.fixes]
    header, right = list(HEADER), [False, False, True, True, True, True, False, False]
    memory = [memory_cell(f) for f in run.fixes]
    if any(cell != "-" for cell in memory):  # the allocator's peaks, where a run read them
        header.insert(4, "peak memory before -> after")
        right.insert(4, True)
        for row, cell in zip(rows, memory, strict=True):
            row.insert(4, cell)
    lines += markdown_table(header, rows, right=right)
    measured = [f for f in run.fixes if f.status == "measured"]
    if run.env.device.startswith("cuda") and measured and all(
            f.after_j_per_step is None for f in measured):
        lines += ["", "J/step: not measured, the timed windows were shorter than NVML's "
                  "energy counter can resolve (it moves in ~100 ms steps; gpudiag wants 2 s)."]
    failing = [f for f in run.fixes if f.equivalence == "differs"]
    if failing:
        lines += ["", "Not recommended as measured: "
                  + "; ".join(f"{f.title} changed the losses by {f.loss_gap:.2%}"
                              for f in failing if f.loss_gap is not None) + "."]
    return [*lines, ""]


def fixes_table(run: RunResult) -> Table:
    """The terminal's "Measured fixes": a block per fix, ranked, not report.md's seven columns
    (at 100 columns those broke paths and settings mid-word). Its name and findings; what was
    measured; the change to make, each on its own lines, wrapped between words."""
    table = Table.grid(padding=(0, 1, 1, 0), collapse_padding=False)  # a blank line between
    table.title, table.title_justify, table.title_style = "Measured fixes", "left", "bold"
    table.add_column(no_wrap=True, justify="right")
    table.add_column(overflow="fold")  # between words; only a word wider than the terminal folds
    priced = timed_shares(run)
    for rank, fix in enumerate(run.fixes, 1):
        name, findings, ms, speedup, price, energy, same, change = fix_cells(
            fix, price_of(fix, priced))
        # Cells are text, not markup: a stage or a path may hold brackets.
        block = Text(name, style="bold")
        block.append(f" ({findings})" if findings != "-" else "")
        measured = [f"{label} {value}".strip() for label, value in (
            ("ms/step (mean)", ms), ("speedup", speedup), ("", price), ("J/step", energy),
            ("peak memory", memory_cell(fix))) if value != "-"]
        if same != "-":
            measured.append(same)
        if measured:
            block.append("\n" + " | ".join(measured))
        block.append(f"\nmake it permanent: {change}" if recommended(fix) else f"\n{change}")
        table.add_row(f"{rank}.", block)
    return table


# --- where the re-runs ran ------------------------------------------------------------------

def _shown(path: str, source: str) -> str:
    """A path under the copied folder relative to it (the run folder is usually there)."""
    return str(PurePath(path).relative_to(source)) if PurePath(path).is_relative_to(source) \
        else path


def _listed(paths: list[str], total: int | None = None, *, more: bool = False) -> str:
    rest = (total - len(paths)) if total is not None else 0
    tail = f" and {rest} more" if rest > 0 else (" and more" if more else "")
    return ", ".join(paths) + tail


def rerun_warning(rerun: Rerun) -> str | None:
    """One line when a re-run reached outside its scratch copy: what it wrote there, and any
    file of the user's it changed through a link; None when it did neither."""
    parts = []
    if rerun.changed_linked:
        parts.append("CHANGED your file(s), linked not copied: "
                     + _listed(rerun.changed_linked))
    if rerun.touched:
        parts.append("CHANGED your files while it ran: " + _touched(rerun))
    if rerun.wrote_outside:
        parts.append(_outside_verb(rerun) + " outside its scratch copy: "
                     + _listed(rerun.wrote_outside, more=rerun.more_outside))
    return f"{rerun.label}: {'; '.join(parts)}" if parts else None


def _touched(rerun: Rerun) -> str:
    """Each line names a file and may hold commas: they are kept apart by semicolons."""
    rest = rerun.touched_count - len(rerun.touched)
    return "; ".join(rerun.touched) + (f"; and {rest} more" if rest > 0 else "")


def _outside_verb(rerun: Rerun) -> str:
    return "was refused writing" if rerun.confined else "wrote"


def reruns_markdown(run: RunResult) -> list[str]:
    """report.md's "Where the re-runs ran": each re-run's scratch copy, what was linked
    instead of copied, and what it wrote outside the copy."""
    if not run.reruns:
        return []
    source = run.reruns[0].source
    confined = all(r.confined for r in run.reruns)
    first = ([] if any(r.label == DIAGNOSIS_RUN for r in run.reruns) else
             [f"The script's first run ran in `{source}`, as it was started."])
    lines = ["## Where the re-runs ran", "", *first,
             f"Each run below ran in a scratch copy of `{source}` (same command, same "
             "arguments" + ("; an absolute path into the folder moved into the copy; the "
                            "folders above it mirrored, so `../data` reads yours"
                            if all(r.mirrored for r in run.reruns) else "")
             + "), so it read the files there as they "
             "were and what it wrote, appended or deleted there stayed in the copy; the copy "
             "keeps only what the run wrote. "
             + ("The kernel (Linux Landlock) kept each from writing anywhere else: what is "
                "linked to yours was read-only to it, and a write outside its copy, its own "
                "folder, temporary files, caches and the folders --rerun-writable named was "
                "refused. Refused writes are those seen through Python's file functions, "
                "torch.save and safetensors." if confined else
                "Writes outside the copy are those seen through Python's file functions, "
                "torch.save and safetensors (not native code's or other programs'); caches "
                "and temporary files are left out."), ""]
    unmirrored = sorted({p for r in run.reruns for p in r.unmirrored})
    if unmirrored:
        lines += [f"Not mirrored (too many entries): {', '.join(unmirrored)}; a path the "
                  "script reads there by `..` is not found in the copy.", ""]
    rows = []
    for rerun in run.reruns:
        linked = _listed(rerun.linked, rerun.linked_count) or "-"
        outside = [f"**CHANGED (linked, not copied):** {_listed(rerun.changed_linked)}"
                   ] if rerun.changed_linked else []
        if rerun.touched:
            outside.append(f"**CHANGED while it ran:** {_touched(rerun)}")
        if rerun.wrote_outside:
            outside.append(_listed(rerun.wrote_outside, more=rerun.more_outside))
        rows.append([rerun.label, f"`{_shown(rerun.cwd, source)}`", f"{rerun.copied:,}",
                     linked, "; ".join(outside) or "nothing seen"])
    lines += markdown_table(("re-run", "ran in", "files copied",
                             "linked to yours instead" + (" (read-only)" if confined else ""),
                             "refused outside its copy" if confined else
                             "wrote outside its copy"), rows, right=[False, False, True, False,
                                                                     False])
    return [*lines, ""]
