"""Count the outcomes of test_fuzz_host.py's inputs by class, without stopping at the first
failure: the figures of docs/RELIABILITY.md ("Limits and argument checks").

    PYTHONPATH=$PWD python3 tests/helpers/fuzz_outcomes.py [examples per function, default 400]

Runs against whichever splitkv is first on the path, so an older tree can be measured with the
same inputs (e.g. ``git archive <commit> splitkv | tar -x -C /tmp/old`` and
PYTHONPATH=/tmp/old); a tree from before the limits existed is given them, so that its results
are judged by the same rules. The inputs are derandomized: every run, on every tree, draws the
same ones. Outcomes: a valid result; a clean error (TypeError/ValueError naming an argument of
the call); or a bad one, listed by class (another exception type, an error naming no argument,
a result that breaks the invariants, a chunk count below 1 planned as 1).
"""

import collections
import re
import sys
import traceback
import warnings
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings

from splitkv.core import validation as V

for name, value in dict(MAX_KV_LEN=2**31 - 1, MAX_PAGE_SIZE=2**31 - 1, MAX_HEADS=2**16 - 1,
                        MAX_CHUNKS=2**24, MAX_BATCH_SIZE=2**24).items():
    if not hasattr(V, name):                          # a tree from before the limits
        setattr(V, name, value)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
import test_fuzz_host as T  # noqa: E402
from splitkv import (DecodeProblem, PageTable, plan_chunk_tokens, plan_fixed_splits,  # noqa: E402
                     plan_from_chunk_counts)
from splitkv.planner import choose_plan  # noqa: E402

LAYOUT_ARGS = {"page_table", "page_size", *T.LAYOUT_NAMES["flashinfer"], *T.LAYOUT_NAMES["vllm"]}


def check_problem(p, args):
    assert (p.kv_lens <= V.MAX_KV_LEN).all() and p.num_qo_heads <= V.MAX_HEADS, "past a limit"
    assert p.page_size <= V.MAX_PAGE_SIZE, "page_size past the limit"
    assert p.total_tokens == sum(int(n) for n in p.kv_lens), "total_tokens wrapped"


def check_counts(plan, args):
    T.assert_valid_plan(plan)
    want = np.minimum(np.asarray(args["chunks_per_request"], dtype=np.int64),
                      T.tiles(plan.problem.kv_lens, int(args["align"])))
    assert (plan.chunks_per_request == want).all(), "a count below 1 planned as 1"


# name: (arguments, call, what a valid result must satisfy, the argument names)
CASES = {
    "PageTable.from_block_table": (T.block_tables(), lambda a: PageTable.from_block_table(**a),
                                   lambda r, a: T.assert_valid_table(r), None),
    "PageTable.from_flashinfer": (T.flashinfer_tables(), lambda a: PageTable.from_flashinfer(**a),
                                  lambda r, a: T.assert_valid_table(r), None),
    "PageTable.from_layout": (T.layouts(), lambda a: PageTable.from_layout(a[0], a[1], **a[2]),
                              lambda r, a: T.assert_valid_table(r), LAYOUT_ARGS),
    "DecodeProblem": (T.problem_args(), lambda a: DecodeProblem(**a), check_problem, None),
    "plan_fixed_splits": (T.fixed_split_args(), lambda a: plan_fixed_splits(**a),
                          lambda r, a: T.assert_valid_plan(r), None),
    "plan_chunk_tokens": (T.chunk_token_args(), lambda a: plan_chunk_tokens(**a),
                          lambda r, a: T.assert_valid_plan(r), None),
    "plan_from_chunk_counts": (T.chunk_count_args(), lambda a: plan_from_chunk_counts(**a),
                               check_counts, None),
    "choose_plan": (T.choose_args(), lambda a: choose_plan(**a),
                    lambda r, a: T.assert_valid_plan(r), None),
}


def classify(call, check, args, names) -> str:
    try:
        with T.small_chunk_limit():
            result = call(args)
    except (TypeError, ValueError) as e:
        first = re.match(r"\w+", str(e))
        if first and first.group(0) in names:
            return "clean error"
        return f"{type(e).__name__} naming no argument: {str(e)[:70]}"
    except Exception as e:                                          # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:70]}"
    try:
        check(result, args)
    except AssertionError as e:
        where = str(e).splitlines()[0] if str(e) else traceback.extract_tb(e.__traceback__)[-1].line
        return f"invalid result: {where[:80]}"
    return "valid"


def main(examples: int) -> int:
    total = collections.Counter()
    for fname, (strategy, call, check, names) in CASES.items():
        seen = collections.Counter()

        @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def run(args):
            seen[classify(call, check, args, names or set(args))] += 1

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run()
        n = sum(seen.values())
        bad = n - seen["valid"] - seen["clean error"]
        print(f"{fname}: {n} calls, {seen['valid']} valid, {seen['clean error']} clean errors, "
              f"{bad} bad")
        for outcome, count in seen.most_common():
            if outcome not in ("valid", "clean error"):
                print(f"    {count:4d}  {outcome}")
        total.update(seen)
    n = sum(total.values())
    bad = n - total["valid"] - total["clean error"]
    print(f"total: {n} calls, {total['valid']} valid, {total['clean error']} clean errors, "
          f"{bad} bad")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 400))
