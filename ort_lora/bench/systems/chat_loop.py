"""A chat trace's clients over a step-driven engine: conversations start at their arrival
times, each next turn is sent when the previous one finished, with the whole history as its
prompt (bench/prefix.py describes the trace and its JSON).

Standard library only: vLLM's venv runs it too (vllm_child.py), so both systems are driven by
the same code, and their token times are stamped the same way.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable

# one advanced request: (request id, its output token ids so far, finished, cached prompt
# tokens as the engine reports them, None where it does not)
Advanced = tuple[str, list[int], bool, int | None]


def conversations(doc: dict) -> list[dict]:
    """Each conversation of a chat trace's JSON: adapter, system prompt ids, start time (s)
    and its turns' request indices in order."""
    reqs, chat = doc["requests"], doc["chat"]
    out = []
    for c in chat["conversations"]:
        first = reqs[c["requests"][0]]
        system = [] if c["system"] is None else chat["system_prompts"][c["system"]]
        out.append(
            {
                "adapter": first["adapter"],
                "system": list(system),
                "start_s": first["arrival_s"],
                "turns": list(c["requests"]),
            }
        )
    return out


def drive(
    doc: dict,
    submit: Callable[[str, list[int], int, int | None], None],
    step: Callable[[], Iterable[Advanced]],
    busy: Callable[[], bool],
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Run a chat trace: submit(request id, prompt ids, max_tokens, adapter index) queues a
    request, step() runs one engine step, busy() says whether requests are unfinished.

    Returns lists over the trace's requests: sent_s (when the client sent it: its
    conversation's start, or its previous turn's last token), token_s (when each output
    token appeared), prompt_tokens, cached_tokens (the most the engine reported; 0 if none)."""
    reqs, convs = doc["requests"], conversations(doc)
    n = len(reqs)
    got = {"sent_s": [0.0] * n, "token_s": [[] for _ in range(n)]}
    got.update(prompt_tokens=[0] * n, cached_tokens=[0] * n)
    history = [list(c["system"]) for c in convs]
    ready = [(c["start_s"], ci, 0) for ci, c in enumerate(convs)]  # (send at, conversation, turn)
    heapq.heapify(ready)
    turn_of: dict[int, tuple[int, int]] = {}
    done, t0 = 0, time.perf_counter()
    while ready or busy():
        now = time.perf_counter() - t0
        while ready and ready[0][0] <= now:
            at, ci, k = heapq.heappop(ready)
            i = convs[ci]["turns"][k]
            history[ci] += reqs[i]["prompt_ids"]
            got["sent_s"][i], got["prompt_tokens"][i] = at, len(history[ci])
            turn_of[i] = (ci, k)
            submit(str(i), list(history[ci]), reqs[i]["max_tokens"], convs[ci]["adapter"])
        if not busy():
            time.sleep(max(0.0, ready[0][0] - now))
            continue
        advanced = list(step())
        stamp = time.perf_counter() - t0
        for rid, ids, finished, cached in advanced:
            i = int(rid)
            tokens = got["token_s"][i]
            tokens.extend([stamp] * (len(ids) - len(tokens)))
            got["cached_tokens"][i] = max(got["cached_tokens"][i], cached or 0)
            if not finished:
                continue
            ci, k = turn_of.pop(i)
            history[ci] += list(ids)
            if k + 1 < len(convs[ci]["turns"]):
                heapq.heappush(ready, (stamp, ci, k + 1))
            done += 1
            if progress is not None:
                progress(done, n)
    return got


def cache_stats(got: dict) -> dict:
    """Prompt tokens, cached prompt tokens and their ratio (the prefix cache's hit rate)."""
    prompt, cached = sum(got["prompt_tokens"]), sum(got["cached_tokens"])
    return {
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
    }


def progress_printer(label: str, every_s: float = 10.0, out=None) -> Callable[[int, int], None]:
    """A progress callback printing "label: done/total requests" at most every `every_s`
    seconds, and at the end (to `out`, default stderr: the bench log)."""
    import sys

    last = [-every_s]

    def report(done: int, total: int) -> None:
        now = time.perf_counter()
        if done == total or now - last[0] >= every_s:
            last[0] = now
            print(f"{label}: {done}/{total} requests finished", file=out or sys.stderr, flush=True)

    return report
