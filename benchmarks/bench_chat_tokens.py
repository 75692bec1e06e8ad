"""A chat turn's tokenization in the front door: the whole rendered prompt against the
segment cache (router/api/segment_cache.py), side by side, per built-in model's tokenizer.

    python benchmarks/bench_chat_tokens.py [--turns 8] [--conversations 20]

Each conversation: a ~1,000-character system prompt, then ``--turns`` user turns (a
~130-character question each) and short assistant answers; every turn's prompt is
rendered through the model's chat template and tokenized both ways (the ids must be the
same, or the run stops). Printed: CPU microseconds per turn (this thread's, the least of
three passes) and the ratio. ``smollm2-135m`` needs its converted folder (the first use
converts it); ``tiny`` is built locally.
"""

from __future__ import annotations

import argparse
import random
import time

from kvroute.replica.model.models import smollm2_path, tiny_model_path
from kvroute.router.api.segment_cache import SegmentEncoder

from transformers import AutoTokenizer  # isort: skip  (after kvroute: its torch workaround)


def conversations(tok, n: int, turns: int, seed: int) -> list[list[str]]:  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    out = []
    for c in range(n):
        msgs = [{"role": "system", "content": f"You are assistant {c} of a routing firm. " * 25}]
        texts = []
        for t in range(turns):
            q = " ".join(f"word{rng.randrange(10_000)}" for _ in range(16))
            msgs.append({"role": "user", "content": f"Question {t}: {q}?"})
            texts.append(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
            msgs.append({"role": "assistant", "content": f"Answer {t}: " + q[:60]})
        out.append(texts)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--conversations", type=int, default=20)
    args = ap.parse_args()
    print("| tokenizer | splits | whole us/turn | segments us/turn | ratio | pieces re-used |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, path in (("tiny", tiny_model_path), ("smollm2-135m", smollm2_path)):
        tok = AutoTokenizer.from_pretrained(path())
        convs = conversations(tok, args.conversations, args.turns, seed=1)
        n = sum(len(c) for c in convs)
        whole_us = seg_us = float("inf")
        enc = SegmentEncoder(tok)
        for _ in range(3):
            enc = SegmentEncoder(tok)  # a cold cache each pass
            t0 = time.thread_time()
            want = [[list(tok(t, add_special_tokens=False).input_ids) for t in c] for c in convs]
            t1 = time.thread_time()
            got = [[enc(t) for t in c] for c in convs]
            t2 = time.thread_time()
            assert got == want, f"{name}: the segment cache's ids differ"
            whole_us = min(whole_us, (t1 - t0) / n * 1e6)
            seg_us = min(seg_us, (t2 - t1) / n * 1e6)
        share = enc.hits / max(enc.hits + enc.misses, 1)
        print(f"| {name} | {enc.splits} | {whole_us:.0f} | {seg_us:.0f} | "
              f"{whole_us / seg_us:.2f}x | {share:.0%} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
