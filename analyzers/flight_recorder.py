"""Flight-recorder dumps compared across ranks: mismatches, missing ranks and the laggard wavefront.

PyTorch's flight recorder keeps, per rank, a ring buffer of the collectives
and point-to-point ops it issued, each with its process group, sequence id,
op name, tensor sizes, dtypes and state. A hang or a wrong result shows as a
disagreement between ranks over the *same* call. The rules follow what
PyTorch's own analyzer (``fr_trace``) checks, re-derived rather than copied:

* A process group is its name plus its member ranks (``pg_config``): two
  ranks' "pg 1" with different members are different groups. Where the dump
  gives no members (gloo writes an empty ``pg_config``), ``default_pg`` spans
  every dumped rank and any other group the ranks that recorded it.
* Within a group, collectives align by ``collective_seq_id``. Ops coalesced
  into one call share a sequence id and align by their position in the call.
  P2P ops align per sender/receiver pair, the k-th send with the k-th recv.
* At each aligned op: the op type, then input/output sizes (except where
  sizes differ by design: all-to-all, the ``_v`` variants, scatter's input
  and gather's output), the op's own size syntax (all-reduce in == out;
  all-gather out == in x group size; reduce-scatter in == out x group size;
  all-to-all's total numel in == out over the group), dtypes (across ranks,
  and in vs out for reductions) and the state. The value most ranks hold is
  taken as right; the others are named. On a tie every rank is named: the
  dump cannot say who is wrong.
* A member rank that has no entry where others have one has not joined it
  ("missing"), unless its buffer wrapped past that point (then it is
  unknown, not accused).
* The wavefront: per group, each rank's last sequence id; the least
  progressed ranks (laggards) first.
* Dumps themselves are judged: empty, wrapped (first record_id > 0) or with
  record gaps, entries with unreadable fields, ranks with no dump at all,
  differing format versions.

Everything here is pure: the caller (``rankscope.formats.flight_recorder``) reads the
files and passes the decoded dicts; malformed content becomes a finding,
never an exception.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rankscope.analyzers.findings import NOT_A_RANK, NOT_A_RANK_ADVICE, NOT_A_RANK_PREFIX, Finding
from rankscope.contract.fr_records import INTS, FrOp, parse_members, read_entry, whole_number
from rankscope.contract.ranks import compact_ranks
from rankscope.contract.vocabulary import Shape, is_send, matching_op, tensor_rule

MISMATCH_CAP = 10  # per group, like fr_trace's default: past this the dump is more noise than signal

# How far an entry got; an unknown state is never taken as behind.
_STATE_RANK = {"scheduled": 0, "started": 1, "completed": 2}

ADVICE = {
    "fr-op-mismatch": "the ranks called different collectives at the same point: a program divergence "
                      "(a rank-dependent branch); evicting machines will not cure it, fix the code path",
    "fr-size-mismatch": "the ranks passed tensors of different shapes to one collective: a program or data "
                        "mismatch; evicting machines will not cure it, check the shapes at this call",
    "fr-dtype-mismatch": "the ranks passed different dtypes to one collective: fix the caller (a cast on "
                         "some ranks only, or mixed precision set per rank)",
    "fr-state-mismatch": "some ranks finished or started this collective and others did not: look at the "
                         "stacks of the ranks still behind",
    "fr-missing-ranks": "these ranks never entered the collective the others are in: look at their stacks "
                        "for what they do instead; if they are stuck in hardware or I/O, evict their machines",
    "fr-missing-dump": "collect a dump from every rank (TORCH_FR_DUMP_TEMP_FILE on shared storage), or judge "
                       "with what is here knowing those ranks are unseen",
    "fr-empty-dump": "set TORCH_FR_BUFFER_SIZE (e.g. 2000) in that rank's environment before the job starts",
    "fr-truncated-dump": "raise TORCH_FR_BUFFER_SIZE so the buffer holds the whole window of interest; "
                         "ops before the wrap cannot be compared",
    "fr-unreadable-dump": "the file is cut short or not a dump (a rank killed while writing it?): dump that "
                          "rank again, or judge without it",
    "fr-malformed-entry": "the dump is damaged or from an unknown format version: re-dump it, or read it "
                          "with the torch version that wrote it",
    "fr-version-mismatch": "dumps from different torch versions: collect them again from one job",
    "fr-mismatch-cap": "fix the first mismatches listed; later ones are usually their consequence",
}
_ORDER = tuple(ADVICE)
# Findings about the job rather than about the dumps: they make the headline.
SERIOUS = frozenset(("fr-op-mismatch", "fr-size-mismatch", "fr-dtype-mismatch", "fr-state-mismatch",
                     "fr-missing-ranks", "fr-mismatch-cap"))


@dataclass(frozen=True, slots=True)
class RankProgress:
    """Where one rank stands in one group: its last collective."""

    rank: int
    last_seq: int | None  # None: no entry in this group
    op: str = ""
    state: str = ""
    ops_at_last: int = 0  # entries at last_seq: a coalesced call one rank entered only partly

    @property
    def key(self) -> tuple[int, int, int]:
        """Progress order: sequence id, then ops entered of that call, then how far the last one got."""
        if self.last_seq is None:
            return (-1, 0, 0)
        return (self.last_seq, self.ops_at_last, _STATE_RANK.get(self.state, len(_STATE_RANK)))


@dataclass(frozen=True, slots=True)
class GroupWavefront:
    """One group's progress, laggards first."""

    communicator: str
    members: tuple[int, ...]
    least_seq: int | None  # None: some member recorded nothing in this group
    head_seq: int | None
    behind: tuple[int, ...]  # the least-progressed ranks
    ahead: tuple[int, ...]  # the most-progressed ranks (empty when nobody lags)
    ranks: tuple[RankProgress, ...]  # laggard first
    next_op: str = ""  # what the ahead ranks entered after the laggards' last op
    no_dump: tuple[int, ...] = ()
    unknown: tuple[int, ...] = ()  # wrapped buffers holding nothing of this group

    @property
    def lagging(self) -> bool:
        return bool(self.ahead)


@dataclass(frozen=True, slots=True)
class FrAnalysis:
    findings: tuple[Finding, ...]
    wavefront: tuple[GroupWavefront, ...]


# ---------------------------------------------------------------- dumps


@dataclass(slots=True)
class _Dump:
    rank: int
    ops: list[FrOp] = field(default_factory=list)
    members: dict[str, tuple[int, ...]] = field(default_factory=dict)  # pg name -> members, from pg_config
    descs: dict[str, str] = field(default_factory=dict)  # pg name -> pg_config's description
    wrapped: bool = False


def _read_dumps(dumps: Mapping[int, Any], findings: list[Finding]) -> dict[int, _Dump]:
    out: dict[int, _Dump] = {}
    versions: dict[str, list[int]] = {}
    for rank in sorted(r for r in dumps if isinstance(r, int)):
        raw = dumps[rank]
        if not isinstance(raw, Mapping) or not isinstance(raw.get("entries", None), list | tuple):
            findings.append(_finding("fr-malformed-entry", (rank,), f"rank {rank}'s dump has no list of entries",
                                     (f"rank {rank}: got {type(raw).__name__} without 'entries'",)))
            continue
        dump = _Dump(rank)
        version = raw.get("version")
        if isinstance(version, str | int | float):
            versions.setdefault(str(version), []).append(rank)
        cfg = raw.get("pg_config")
        if isinstance(cfg, Mapping):
            for key, pg in cfg.items():
                if isinstance(pg, Mapping):
                    members = parse_members(pg.get("ranks"))
                    name = str(pg.get("name", key))
                    if members:
                        dump.members[name] = members
                    if isinstance(pg.get("desc"), str) and pg["desc"]:
                        dump.descs[name] = pg["desc"]
        entries = raw["entries"]
        if not entries:
            findings.append(_finding("fr-empty-dump", (rank,), f"rank {rank}'s dump holds no entries",
                                     (f"rank {rank}: 0 entries (the recorder was off, or the rank issued "
                                      "no collective)",)))
        bad: Counter[str] = Counter()
        first_bad: dict[str, int | None] = {}
        for raw_entry in entries:
            op, problems = read_entry(raw_entry, rank)
            for p in problems:
                bad[p] += 1
                rid = whole_number(raw_entry.get("record_id")) if isinstance(raw_entry, Mapping) else None
                first_bad.setdefault(p, rid)
            if op is not None:
                dump.ops.append(op)
        if bad:
            findings.append(_finding(
                "fr-malformed-entry", (rank,),
                f"rank {rank}: {sum(bad.values())} unreadable field(s) in its dump",
                tuple(f"rank {rank}: {p} unreadable in {n} entr{'y' if n == 1 else 'ies'}"
                      + (f" (first at record {first_bad[p]})" if first_bad[p] is not None else "")
                      for p, n in sorted(bad.items()))))
        _check_records(dump, [i for e in entries if isinstance(e, Mapping)
                              for i in [whole_number(e.get("record_id"))] if i is not None], findings)
        out[rank] = dump
    if len(versions) > 1:
        findings.append(_finding(
            "fr-version-mismatch", tuple(sorted(r for rs in versions.values() for r in rs)),
            "the dumps come from different flight-recorder versions",
            tuple(f"version {v}: ranks {compact_ranks(rs)}" for v, rs in sorted(versions.items()))))
    return out


def _check_records(dump: _Dump, ids: list[int], findings: list[Finding]) -> None:
    if not ids:
        return
    evidence: list[str] = []
    if ids[0] > 0:
        dump.wrapped = True
        evidence.append(f"rank {dump.rank}: first record is {ids[0]}: the ring buffer wrapped, "
                        f"records 0-{ids[0] - 1} were overwritten")
    gaps = [(a, b) for a, b in itertools.pairwise(ids) if b != a + 1]
    if gaps:
        dump.wrapped = True  # entries are missing inside the window: treat the start as unknown too
        shown = ", ".join(f"{a}->{b}" for a, b in gaps[:5]) + (" ..." if len(gaps) > 5 else "")
        evidence.append(f"rank {dump.rank}: record ids jump at {shown} ({len(gaps)} gap(s) or reorderings)")
    if evidence:
        findings.append(_finding("fr-truncated-dump", (dump.rank,),
                                 f"rank {dump.rank}'s dump does not hold its whole history", tuple(evidence)))


# ---------------------------------------------------------------- groups


@dataclass(slots=True)
class _Group:
    name: str
    desc: str
    members: tuple[int, ...]
    ops: dict[int, list[FrOp]]  # rank -> its ops in this group, in record order
    qualify: bool = False  # another group has the same name: show the members too

    @property
    def label(self) -> str:
        base = f"{self.name}:{self.desc}" if self.desc and self.desc != "undefined" else self.name
        return f"{base} {_fmt(self.members)}" if self.qualify else base


def _groups(dumps: Mapping[int, _Dump], others: set[int]) -> list[_Group]:
    """The groups the entries name; ``others``: job ranks without a usable dump."""
    keyed: dict[tuple[str, tuple[int, ...] | None], _Group] = {}
    for dump in dumps.values():
        for op in dump.ops:
            members = dump.members.get(op.pg_name)
            key = (op.pg_name, members)
            grp = keyed.get(key)
            if grp is None:
                grp = keyed[key] = _Group(op.pg_name, dump.descs.get(op.pg_name, op.pg_desc), members or (), {})
            grp.ops.setdefault(dump.rank, []).append(op)
    for (_, members), grp in keyed.items():
        if members is None:  # no pg_config: the default group spans every dump, others whoever recorded them
            recorders = set(grp.ops)
            grp.members = tuple(sorted(set(dumps) | others if grp.desc == "default_pg" else recorders))
    names = Counter(g.name for g in keyed.values())
    for grp in keyed.values():
        grp.qualify = names[grp.name] > 1
    return sorted(keyed.values(), key=lambda g: (g.name, g.members))


# ---------------------------------------------------------------- comparing


def _fmt(value: Any) -> str:
    if isinstance(value, tuple):
        return str(_listify(value))
    return str(value)


def _listify(value: Any) -> Any:
    return [_listify(v) for v in value] if isinstance(value, tuple) else value


def _numel(sizes: tuple[tuple[int, ...], ...]) -> int:
    return sum(math.prod(s) for s in sizes)


def _disagreement(values: Mapping[int, Any]) -> tuple[tuple[int, ...], list[str]] | None:
    """The ranks off the majority value, and one evidence line per value; None if all agree."""
    raw: dict[Any, list[int]] = {}  # values are tuples and strings: group first, format only a disagreement
    for rank, v in sorted(values.items()):
        raw.setdefault(v, []).append(rank)
    if len(raw) < 2:
        return None
    by_value: dict[str, list[int]] = {}
    for v, rs in raw.items():
        by_value.setdefault(_fmt(v), []).extend(rs)
    counts = sorted((len(rs) for rs in by_value.values()), reverse=True)
    tie = counts[0] == counts[1]
    majority = max(by_value, key=lambda k: (len(by_value[k]), -by_value[k][0]))
    odd = tuple(sorted(r for k, rs in by_value.items() if tie or k != majority for r in rs))
    lines = [f"{'rank' if len(rs) == 1 else 'ranks'} {compact_ranks(rs)}: {k}"
             for k, rs in sorted(by_value.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))]
    if len(lines) > 10:
        lines = [*lines[:10], f"... and {len(lines) - 10} more value(s)"]
    return odd, lines


def _where(op: FrOp, label: str) -> str:
    rec = f", record {op.record_id}" if op.record_id is not None else ""
    return f"{op.op} seq {op.seq}{rec} in pg {label}"


def _compare(grp: _Group, at: Mapping[int, FrOp]) -> list[Finding]:
    """Findings for one aligned op held by the ranks in ``at``."""
    ref = at[min(at)]
    where = _where(ref, grp.label)
    found: list[Finding] = []

    def check(kind: str, what: str, values: Mapping[int, Any]) -> bool:
        got = _disagreement(values)
        if got is None:
            return False
        odd, lines = got
        pairs = " vs ".join(f"rank {r} {_fmt(values[r])}" for r in sorted(values)[:2]) if len(values) == 2 else ""
        head = f"{what} disagree at {where}" + (f": {pairs}" if pairs else "")
        found.append(_finding(kind, odd, head, tuple(lines), grp.label))
        return True

    if check("fr-op-mismatch", "op types", {r: op.op for r, op in at.items()}):
        return found  # different ops: their sizes and dtypes mean nothing side by side
    kind = ref.op
    ins = {r: op.input_sizes for r, op in at.items() if op.input_sizes is not None}
    outs = {r: op.output_sizes for r, op in at.items() if op.output_sizes is not None}
    rule = tensor_rule(kind)  # the contract's vocabulary says what must agree, across members and on each rank
    # one size finding per op, input first, as fr_trace reports the first rule an op breaks
    input_off = rule.inputs_agree and check("fr-size-mismatch", "input_sizes", ins)
    if not input_off and rule.outputs_agree:
        check("fr-size-mismatch", "output_sizes", outs)
    n = len(grp.members)
    syntax: dict[int, str] = {}
    for r, op in at.items():
        i, o = op.input_sizes, op.output_sizes
        if i is None or o is None or not i or not o:
            continue
        if rule.shape is Shape.KEPT and i != o:
            syntax[r] = f"input {_fmt(i)} but output {_fmt(o)} (all-reduce keeps the shape)"
        elif rule.shape is Shape.GATHERED and _numel(o) != _numel(i) * n:
            syntax[r] = f"output numel {_numel(o)} != input numel {_numel(i)} x group size {n}"
        elif rule.shape is Shape.SCATTERED and _numel(i) != _numel(o) * n:
            syntax[r] = f"input numel {_numel(i)} != output numel {_numel(o)} x group size {n}"
    if syntax:
        found.append(_finding("fr-size-mismatch", tuple(sorted(syntax)), f"sizes break {kind}'s rule at {where}",
                              tuple(f"rank {r}: {s}" for r, s in sorted(syntax.items())), grp.label))
    if rule.totals_agree and len(at) == n and all(r in ins and r in outs for r in at):
        total_in, total_out = sum(_numel(ins[r]) for r in at), sum(_numel(outs[r]) for r in at)
        if total_in != total_out:
            found.append(_finding("fr-size-mismatch", tuple(sorted(at)), f"{kind} sends and receives differ at {where}",
                                  (f"total input numel {total_in} vs total output numel {total_out} "
                                   "over the group",), grp.label))
    # dtypes count only where the side holds data: a non-root gather records an empty output
    dt_in = {r: tuple(sorted(set(op.input_dtypes))) for r, op in at.items()
             if op.input_dtypes and op.input_sizes and any(op.input_sizes)}
    dt_out = {r: tuple(sorted(set(op.output_dtypes))) for r, op in at.items()
              if op.output_dtypes and op.output_sizes and any(op.output_sizes)}
    if not (rule.input_dtypes_agree and check("fr-dtype-mismatch", "input_dtypes", dt_in)) \
            and rule.output_dtypes_agree:
        check("fr-dtype-mismatch", "output_dtypes", dt_out)
    if rule.dtype_kept:
        own = {r: f"input {list(dt_in[r])} but output {list(dt_out[r])}" for r in at
               if r in dt_in and r in dt_out and dt_in[r] != dt_out[r]}
        if own:
            found.append(_finding("fr-dtype-mismatch", tuple(sorted(own)), f"dtypes change inside {kind} at {where}",
                                  tuple(f"rank {r}: {s}" for r, s in sorted(own.items())), grp.label))
    check("fr-state-mismatch", "states", {r: op.state for r, op in at.items() if op.state is not None})
    return found


def _analyze_group(grp: _Group, dumps: Mapping[int, _Dump]) -> tuple[list[Finding], GroupWavefront | None]:
    findings: list[Finding] = []
    present = [r for r in grp.members if r in dumps]
    calls: dict[int, dict[int, list[FrOp]]] = {}  # rank -> seq -> ops of that collective call
    for r in present:
        per: dict[int, list[FrOp]] = {}
        for op in grp.ops.get(r, []):
            if not op.is_p2p:
                per.setdefault(op.seq, []).append(op)
        calls[r] = per

    bounds = {r: (min(per), max(per)) for r, per in calls.items() if per}

    def status(r: int, seq: int) -> str:
        """'in', 'partial' (the call may have lost its head to a wrap), 'missing' (has not joined) or
        'unknown' (its buffer no longer covers seq)."""
        wrapped = dumps[r].wrapped
        if r not in bounds:
            return "unknown" if wrapped else "missing"
        low, high = bounds[r]
        if seq in calls[r]:
            return "partial" if wrapped and seq == low else "in"
        if seq > high:
            return "missing"
        return "unknown" if wrapped and seq < low else "missing"

    first_missing: dict[int, tuple[int, int, FrOp]] = {}  # rank -> (seq, position, the op others hold)
    mismatches: list[Finding] = []
    for seq in sorted({s for per in calls.values() for s in per}):
        st = {r: status(r, seq) for r in present}
        width = max(len(calls[r].get(seq, [])) for r in present)
        for pos in range(width):
            at: dict[int, FrOp] = {}
            for r in present:
                ops = calls[r].get(seq, [])
                # a wrapped buffer may have lost the head of its first call: align that one from the end
                idx = pos - (width - len(ops)) if st[r] == "partial" else pos
                if st[r] in ("in", "partial") and 0 <= idx < len(ops):
                    at[r] = ops[idx]
            if not at:
                continue
            for r in present:
                if r in at or r in first_missing or st[r] in ("unknown", "partial"):
                    continue
                first_missing[r] = (seq, pos, at[min(at)])
            if len(at) > 1:
                mismatches.extend(_compare(grp, at))
    findings.extend(_missing_findings(grp, first_missing, calls))
    p2p_mismatch, p2p_missing = _p2p(grp, dumps)
    mismatches.extend(p2p_mismatch)
    findings.extend(p2p_missing)
    if len(mismatches) > MISMATCH_CAP:
        rest = mismatches[MISMATCH_CAP:]
        mismatches = mismatches[:MISMATCH_CAP]
        mismatches.append(_finding(
            "fr-mismatch-cap", tuple(sorted({r for f in rest for r in f.ranks})),
            f"{len(rest)} more mismatch(es) in pg {grp.label} not listed",
            tuple(f.summary for f in rest[:5]), grp.label))
    return mismatches + findings, _wavefront(grp, dumps, calls)


def _missing_findings(grp: _Group, first: Mapping[int, tuple[int, int, FrOp]],
                      calls: Mapping[int, Mapping[int, list[FrOp]]]) -> list[Finding]:
    by_point: dict[tuple[int, int], list[int]] = {}
    for r, (seq, pos, _) in first.items():
        by_point.setdefault((seq, pos), []).append(r)
    out: list[Finding] = []
    for (seq, pos), ranks in sorted(by_point.items()):
        ref = first[ranks[0]][2]
        joined = sorted(r for r, per in calls.items() if len(per.get(seq, [])) > pos)
        evidence = [f"{'rank' if len(joined) == 1 else 'ranks'} {compact_ranks(joined)} recorded "
                    f"{_where(ref, grp.label)}"]
        for r in sorted(ranks)[:10]:  # a thousand absent ranks need not be a thousand lines
            per = calls[r]
            last = max(per) if per else None
            evidence.append(f"rank {r}: " + ("no entry in this group" if last is None else
                                             f"last entry seq {last} ({per[last][-1].op}, {per[last][-1].state})"))
        if len(ranks) > 10:
            evidence.append(f"... and {len(ranks) - 10} more rank(s) alike")
        out.append(_finding("fr-missing-ranks", tuple(sorted(ranks)),
                            f"rank(s) {compact_ranks(ranks)} never joined {_where(ref, grp.label)}",
                            tuple(evidence), grp.label))
    return out


def _p2p(grp: _Group, dumps: Mapping[int, _Dump]) -> tuple[list[Finding], list[Finding]]:
    """Pair the k-th send r->q with the k-th recv on q from r; compare sizes and dtypes."""
    members = grp.members
    sends: dict[tuple[int, int], list[FrOp]] = {}
    recvs: dict[tuple[int, int], list[FrOp]] = {}
    for r, ops in grp.ops.items():
        for op in ops:
            if not op.is_p2p or matching_op(op.op) is None:
                continue
            ints = [int(x) for x in INTS.findall(op.peer)]
            if len(ints) != 2:
                continue
            if is_send(op.op):
                src, dst = ints
                book, key = sends, (r, dst)
            else:
                dst, src = ints
                book, key = recvs, (src, r)
            other = dst if is_send(op.op) else src
            if not 0 <= other < len(members):
                continue
            peer = members[other]
            book.setdefault((key[0], peer) if is_send(op.op) else (peer, key[1]), []).append(op)
    mismatch: list[Finding] = []
    missing: list[Finding] = []
    for (a, b) in sorted(set(sends) | set(recvs)):
        s_list, r_list = sends.get((a, b), []), recvs.get((a, b), [])
        for s, rv in zip(s_list, r_list, strict=False):
            where = f"send {a}->{b} (p2p seq {s.seq}) / recv (p2p seq {rv.seq}) in pg {grp.label}"
            if s.input_sizes is not None and rv.output_sizes is not None and s.input_sizes != rv.output_sizes:
                mismatch.append(_finding("fr-size-mismatch", (a, b), f"sizes disagree at {where}",
                                         (f"rank {a} sends {_fmt(s.input_sizes)}",
                                          f"rank {b} receives {_fmt(rv.output_sizes)}"), grp.label))
            if s.input_dtypes and rv.output_dtypes and set(s.input_dtypes) != set(rv.output_dtypes):
                mismatch.append(_finding("fr-dtype-mismatch", (a, b), f"dtypes disagree at {where}",
                                         (f"rank {a} sends {list(s.input_dtypes)}",
                                          f"rank {b} receives {list(rv.output_dtypes)}"), grp.label))
        if len(s_list) == len(r_list) or a not in dumps or b not in dumps:
            continue
        if dumps[a].wrapped or dumps[b].wrapped:
            continue  # counts from different windows cannot be paired
        if len(s_list) > len(r_list):
            late, op, who = b, s_list[len(r_list)], f"rank {a} sent"
        else:
            late, op, who = a, r_list[len(s_list)], f"rank {b} posted a recv"
        missing.append(_finding("fr-missing-ranks", (late,),
                                f"rank {late} never matched {op.op} {a}->{b} (p2p seq {op.seq}) in pg {grp.label}",
                                (f"{who} {max(len(s_list), len(r_list))} time(s), its peer only "
                                 f"{min(len(s_list), len(r_list))}",), grp.label))
    return mismatch, missing


def _wavefront(grp: _Group, dumps: Mapping[int, _Dump],
               calls: Mapping[int, Mapping[int, list[FrOp]]]) -> GroupWavefront | None:
    if not any(calls.get(r) for r in calls):
        return None
    progress: list[RankProgress] = []
    unknown: list[int] = []
    for r in sorted(calls):
        per = calls[r]
        if per:
            last = max(per)
            progress.append(RankProgress(r, last, per[last][-1].op, per[last][-1].state or "", len(per[last])))
        elif dumps[r].wrapped:
            unknown.append(r)
        else:
            progress.append(RankProgress(r, None))
    progress.sort(key=lambda p: (p.key, p.rank))
    if not progress:
        return None
    least_key, head_key = progress[0].key, progress[-1].key
    behind = tuple(p.rank for p in progress if p.key == least_key)
    ahead = tuple(p.rank for p in progress if p.key == head_key and head_key != least_key)
    least, head = progress[0].last_seq, progress[-1].last_seq
    next_op = ""
    if ahead:
        lead = calls[ahead[0]]
        first: FrOp | None = None
        if least is not None and least == head:  # same call: the first of its ops not entered, if any
            ops = lead[least]
            first = ops[least_key[1]] if least_key[1] < len(ops) else None
        else:
            first = lead[min(s for s in lead if least is None or s > least)][0]
        next_op = f"{first.op} seq {first.seq}" if first is not None else ""
    return GroupWavefront(grp.label, grp.members, least, head, behind, ahead, tuple(progress), next_op,
                          tuple(r for r in grp.members if r not in dumps), tuple(unknown))


# ---------------------------------------------------------------- entry point


def _finding(kind: str, ranks: Iterable[int], summary: str, evidence: Sequence[str] = (),
             communicator: str | None = None) -> Finding:
    return Finding(kind, tuple(ranks), summary, tuple(evidence), communicator, ADVICE.get(kind, ""))


def analyze_dumps(dumps: Mapping[int, Any], unreadable: Mapping[int, str] | None = None) -> FrAnalysis:
    """Judge decoded flight-recorder dumps (rank -> the dump's dict); never raises on their content.

    ``unreadable``: ranks whose file could not be decoded, and why; they are
    members of the job (of ``default_pg``) without a dump.
    """
    findings: list[Finding] = []
    bad_files = dict(unreadable or {})
    if bad_files:
        findings.append(_finding("fr-unreadable-dump", sorted(bad_files),
                                 f"{len(bad_files)} dump file(s) could not be read",
                                 tuple(f"rank {r}: {why}" for r, why in sorted(bad_files.items()))[:10]))
    read = _read_dumps(dumps, findings)
    damaged = {r for r in dumps if isinstance(r, int)} - set(read)  # decoded, but no list of entries
    groups = _groups(read, set(bad_files) | damaged)
    no_dump = sorted({r for g in groups for r in g.members} - set(dumps) - set(bad_files))
    if no_dump:
        findings.append(_finding("fr-missing-dump", no_dump, f"no dump from rank(s) {compact_ranks(no_dump)}",
                                 tuple(f"pg {g.label}: members {compact_ranks(g.members)}, no dump from "
                                       f"{compact_ranks([r for r in g.members if r in no_dump])}"
                                       for g in groups if set(g.members) & set(no_dump))[:10]))
    waves: list[GroupWavefront] = []
    for grp in groups:
        got, wave = _analyze_group(grp, read)
        findings.extend(got)
        if wave is not None:
            waves.append(wave)
    findings.extend(_symmetric(waves, findings))
    findings.sort(key=lambda f: _ORDER.index(f.kind) if f.kind in _ORDER else len(_ORDER))
    waves.sort(key=lambda w: (not w.lagging, -((w.head_seq or 0) - (w.least_seq or 0)) if w.lagging else 0,
                              w.communicator))
    return FrAnalysis(tuple(findings), tuple(waves))


_OPEN_STATES = frozenset({"scheduled", "started"})


def _symmetric(waves: Sequence[GroupWavefront], findings: Sequence[Finding]) -> list[Finding]:
    """Groups whose every member's last collective is the same call at the same sequence number, not completed on
    any of them, and that no other finding speaks of: a symmetric stall, "not a rank" (analyzers.not_a_rank)."""
    named = {r for f in findings for r in f.ranks}
    out: list[Finding] = []
    for w in waves:
        if w.lagging or w.no_dump or w.unknown or len(w.members) < 2 or set(w.members) & named:
            continue
        ops = {(p.last_seq, p.op) for p in w.ranks}
        if len(ops) != 1 or any(p.last_seq is None or p.state not in _OPEN_STATES for p in w.ranks):
            continue
        seq, op = next(iter(ops))
        states = sorted({p.state for p in w.ranks})
        out.append(Finding(
            NOT_A_RANK, tuple(w.members),
            f"{NOT_A_RANK_PREFIX}all {len(w.members)} members of pg {w.communicator} (ranks {compact_ranks(w.members, 8)}) wait "
            f"in the same call ({op} seq {seq}, {'/'.join(states)} on every rank): a symmetric stall points at the "
            "communication layer, the network or a GPU driver, not at one rank",
            (f"flight recorder: every member's last collective in pg {w.communicator} is {op} seq {seq}, "
             f"state {'/'.join(states)}; none completed it and none is behind",), w.communicator, NOT_A_RANK_ADVICE))
    return out


def wavefront_line(w: Mapping[str, Any]) -> str:
    """One line for a person from ``wavefront_to_json``'s shape: the group, its laggards, where the others are."""
    if not w["ahead"]:
        return f"pg {w['communicator']}: all {len(w['ranks'])} rank(s) at seq {w['head_seq']}"
    by_rank = {p["rank"]: p for p in w["ranks"]}
    low, high = by_rank[w["behind"][0]], by_rank[w["ahead"][0]]

    def at(p: Mapping[str, Any]) -> str:
        if p["last_seq"] is None:
            return "no entry in this group"
        n = p["ops_at_last_seq"]
        same_seq = low["last_seq"] == high["last_seq"]
        if same_seq and low["ops_at_last_seq"] == high["ops_at_last_seq"]:  # apart only by how far it got
            return f"seq {p['last_seq']} ({p['op']} {p['state'] or 'no state'})"
        return f"seq {p['last_seq']}" + (f" ({n} op{'s' if n != 1 else ''})" if same_seq else "")

    line = (f"pg {w['communicator']}: rank(s) {compact_ranks(w['behind'])} behind at {at(low)}; "
            f"rank(s) {compact_ranks(w['ahead'])} at {at(high)}")
    extra = [f"next: {w['next_op']}"] if w["next_op"] else []
    extra += [f"no dump from {compact_ranks(w['no_dump'])}"] if w["no_dump"] else []
    extra += [f"unknown (wrapped) {compact_ranks(w['unknown'])}"] if w["unknown"] else []
    return line + (f" ({'; '.join(extra)})" if extra else "")


def wavefront_to_json(w: GroupWavefront) -> dict[str, object]:
    return {
        "communicator": w.communicator,
        "members": list(w.members),
        "least_seq": w.least_seq,
        "head_seq": w.head_seq,
        "behind": list(w.behind),
        "ahead": list(w.ahead),
        "next_op": w.next_op,
        "no_dump": list(w.no_dump),
        "unknown": list(w.unknown),
        "ranks": [{"rank": p.rank, "last_seq": p.last_seq, "ops_at_last_seq": p.ops_at_last, "op": p.op,
                   "state": p.state} for p in w.ranks],
    }
