"""LLMEngine: schedule -> run -> sample -> postprocess, one step at a time.

    plan = scheduler.schedule()                       # a value: who runs, which chunk, slots
    copy adapters the plan loads into their pool pages (registry.write_to_pool)
    logits = session.run(build_metadata(plan) | registry.lora_step_inputs(plan.lora_slots))
    tokens = sampler.sample(logits[sample rows])      # + logprobs, prompt logprobs
    postprocess: detokenize, stop checks, scheduler.on_step_done -> RequestOutputs

Single-threaded: call every method from one thread (AsyncEngine runs it on its own thread).
Imports no torch.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ort_lora.adapters import AdapterError, AdapterNotFoundError, AdapterRegistry
from ort_lora.config import EngineConfig
from ort_lora.contract import ModelManifest
from ort_lora.engine.errors import RequestError
from ort_lora.engine.pool import PagePool
from ort_lora.engine.request import Completion, RequestState, seq_id
from ort_lora.engine.sampler import SampleRow, check_stop, prompt_logprobs, sample
from ort_lora.engine.scheduler import Scheduler
from ort_lora.engine.sequence import Sequence, SequenceStatus
from ort_lora.engine.step_plan import MetadataBuffers, StepPlan, build_metadata
from ort_lora.lora_request import LoRARequest
from ort_lora.outputs import PositionLogprobs, RequestOutput
from ort_lora.runtime.session import ModelSession
from ort_lora.sampling_params import SamplingParams
from ort_lora.tokenizer import Tokenizer


@dataclass
class StepTimes:
    """Seconds spent in the last step: host work (schedule, inputs, sampling) and ORT's run."""

    schedule_s: float = 0.0
    inputs_s: float = 0.0
    run_s: float = 0.0
    postprocess_s: float = 0.0
    num_tokens: int = 0
    num_seqs: int = 0

    @property
    def host_s(self) -> float:
        return self.schedule_s + self.inputs_s + self.postprocess_s


class LLMEngine:
    """One exported model, its paged pool, adapters and requests."""

    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        *,
        adapter_root: str | Path | None = None,
        intra_op_num_threads: int | None = None,
        seed: int | None = None,
        device: str = "cpu",
        **config_overrides,
    ):
        self.model_dir = Path(model_dir)
        self.manifest = ModelManifest.load(self.model_dir)
        base = config or EngineConfig(**config_overrides)
        self.config = base.resolved(self.manifest)
        self.num_pages = self.config.num_pages
        self.max_model_len = self.config.max_model_len
        self.session = ModelSession(
            self.model_dir, self.num_pages, intra_op_num_threads, device=device
        )
        self.pool = PagePool(self.num_pages)
        if self.config.prefetch_adapters is None:  # copies overlap with steps only on a GPU
            self.config = replace(self.config, prefetch_adapters=device == "cuda")
        self.scheduler = Scheduler(self.config, self.pool)
        self._failures: list[tuple[str, Exception]] = []
        self._evicted: list = []  # evictions of plans not run: the next run waits for them
        self.registry = AdapterRegistry(self.manifest, self.config.max_cpu_loras, adapter_root)
        self.tokenizer = Tokenizer.from_model_dir(self.model_dir)
        self.eos_token_ids = list(self.manifest.eos_token_ids)
        self.rng = np.random.default_rng(seed)
        self.buffers = MetadataBuffers()
        self.requests: dict[str, RequestState] = {}
        self._owner: dict[str, tuple[RequestState, Completion]] = {}  # seq id -> owner
        self._adapter_users: dict[int, int] = {}  # adapter int id -> unfinished sequences
        self._draining: dict[int, str] = {}  # adapters being unloaded: id -> name
        self.times = StepTimes()

    # ---- adapters ---------------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Register (validate and convert) an adapter; AdapterError names the problem."""
        if lora_request.lora_name in self._draining.values():
            raise ValueError(f"adapter {lora_request.lora_name!r} is being unloaded; retry")
        self.registry.register(lora_request)

    def remove_lora(self, name_or_id: str | int) -> None:
        """Unload an adapter: new requests for it fail at once; running ones finish first."""
        request = self.registry.request(name_or_id)
        aid = request.lora_int_id
        if aid in self._draining:
            raise AdapterNotFoundError(f"adapter not found: {name_or_id!r} (being unloaded)")
        self._draining[aid] = request.lora_name
        self._finish_drains()

    def list_loras(self) -> list[LoRARequest]:
        return [r for r in self.registry.requests() if r.lora_int_id not in self._draining]

    def resolve_lora(self, lora_request: LoRARequest) -> LoRARequest:
        """The registered request for this one (registering it on first use)."""
        name, aid = lora_request.lora_name, lora_request.lora_int_id
        if aid in self._draining or name in self._draining.values():
            raise AdapterNotFoundError(f"adapter not found: {name!r} (being unloaded)")
        if name in self.registry:
            return self.registry.request(name)
        self.registry.register(lora_request)
        return lora_request

    def _finish_drains(self) -> None:
        for aid in [a for a in self._draining if not self._adapter_users.get(a)]:
            self.pool.drop_adapter(aid)
            self.registry.unregister(aid)
            del self._draining[aid]

    # ---- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestState:
        """Queue a request; RequestError / AdapterError (ValueError) when it cannot be served."""
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        text, ids = self._prompt_ids(prompt)
        max_tokens = self._max_tokens(ids, params)
        lora = self.resolve_lora(lora_request) if lora_request is not None else None
        aid = lora.lora_int_id if lora else None
        pages = self.registry.num_pages_needed(aid) if lora else 0
        seqs = [
            Sequence(
                seq_id(request_id, i),
                ids,
                max_tokens,
                aid,
                pages,
                params,
                wants_prompt_logprobs=params.prompt_logprobs is not None and i == 0,
            )
            for i in range(params.n)
        ]
        for i, seq in enumerate(seqs):
            try:
                self.scheduler.add(seq)
            except ValueError as e:
                for s in seqs[:i]:
                    self.scheduler.abort(s.request_id)
                raise RequestError(str(e)) from e
        state = RequestState.create(request_id, text, ids, params, lora, seqs, self.tokenizer)
        self.requests[request_id] = state
        for c in state.completions:
            self._owner[c.seq.request_id] = (state, c)
        if aid is not None:
            self._adapter_users[aid] = self._adapter_users.get(aid, 0) + len(seqs)
        return state

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            ids, text = [int(t) for t in prompt], None
        if not ids:
            raise RequestError("the prompt is empty; expected at least one token")
        vocab = self.manifest.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
            )
        return text, ids

    def _max_tokens(self, ids: list[int], params: SamplingParams) -> int:
        limit = self.max_model_len
        if len(ids) >= limit:
            raise RequestError(
                f"the prompt has {len(ids)} tokens; this model's context is {limit} tokens "
                "(prompt + output), so the prompt must be shorter"
            )
        if params.max_tokens is None:
            return limit - len(ids)
        if len(ids) + params.max_tokens > limit:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{len(ids) + params.max_tokens} exceeds this model's context of {limit} tokens"
            )
        return params.max_tokens

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Cancel a request; its pages are free at once. Returns its final output."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        for c in state.completions:
            if c.finish_reason is None:
                self.scheduler.abort(c.seq.request_id)
                c.finish_reason = "abort"
        return self._retire(state)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one forward pass; return the outputs of requests that advanced or finished."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        failed = self._load_adapters(plan)
        if failed:
            self._fail_adapters(plan, failed)
            return []
        t1 = time.perf_counter()
        inputs = build_metadata(plan, self.manifest.block_size, buffers=self.buffers)
        inputs.update(self.registry.lora_step_inputs(plan.lora_slots, self.num_pages))
        t2 = time.perf_counter()
        # wait for the step's adapters, and for copies into pages evicted while scheduling
        used = [aid for _, aid, _ in plan.lora_slots] + list(plan.evicted) + self._evicted
        self._evicted = []
        logits = self.session.run(inputs, used)  # [plan.num_logit_rows, vocab]
        t3 = time.perf_counter()
        touched = self._postprocess(plan, logits)
        t4 = time.perf_counter()
        self.times = StepTimes(
            t1 - t0, t2 - t1, t3 - t2, t4 - t3, plan.num_tokens, len(plan.entries)
        )
        return [self._retire(s) if s.finished else s.output() for s in touched]

    def take_failures(self) -> list[tuple[str, Exception]]:
        """(request id, error) of requests ended since the last call because their adapter
        could not be loaded into the pool (AsyncEngine and LLM raise these for them)."""
        out, self._failures = self._failures, []
        return out

    def _load_adapters(self, plan: StepPlan) -> dict:
        """Copy the plan's loads and prefetches in; {adapter id: error} for those that fail
        (e.g. the adapter's files changed on disk since it was registered)."""
        failed = {}
        for a in plan.loads + plan.prefetch:
            write = functools.partial(self.registry.write_to_pool, a.adapter_id)
            try:
                self.session.load_adapter(a.adapter_id, a.pages, write)
            except (AdapterError, OSError) as e:
                failed[a.adapter_id] = e
        return failed

    def _fail_adapters(self, plan: StepPlan, failed: dict) -> None:
        """End every request of a failed adapter with its error and drop the adapter from
        the pool (it is resident without its weights). The plan is not run: the scheduler
        schedules the other sequences again next step (their pages stay allocated)."""
        self._evicted.extend(plan.evicted)  # the next step that runs waits for these
        for state in list(self.requests.values()):
            aid = state.lora_request.lora_int_id if state.lora_request else None
            if aid in failed:
                name = state.lora_request.lora_name
                error = AdapterError(f"adapter {name!r} could not be loaded: {failed[aid]}")
                self._failures.append((state.request_id, error))
                self.abort_request(state.request_id)
        for aid in failed:
            self.pool.drop_adapter(aid)

    def _postprocess(self, plan: StepPlan, logits: np.ndarray) -> list[RequestState]:
        touched: dict[str, RequestState] = {}
        for e in plan.entries:
            if e.num_prompt_logit_rows and e.request_id in self._owner:
                state, _ = self._owner[e.request_id]
                self._add_prompt_logprobs(state, e, logits)
                touched[state.request_id] = state
        sampled, stopped = self._sample(plan, logits, touched)
        done = self.scheduler.on_step_done(plan, sampled, stopped)
        for seq in done:
            _, c = self._owner.pop(seq.request_id)
            self._finish(c, seq.status.finish_reason)
        return list(touched.values())

    def _add_prompt_logprobs(self, state: RequestState, e, logits: np.ndarray) -> None:
        rows = logits[e.logits_offset : e.logits_offset + e.num_prompt_logit_rows]  # [k, V]
        positions = [e.start_pos + r for r in e.logit_rows[: e.num_prompt_logit_rows]]
        nxt = [state.prompt_token_ids[p + 1] for p in positions]
        lps = prompt_logprobs(rows, nxt, state.params.prompt_logprobs)
        state.prompt_logprobs.extend(self._decorate(lp) for lp in lps)

    def _sample(self, plan: StepPlan, logits: np.ndarray, touched: dict):
        entries = [e for e in plan.entries if e.sample and e.request_id in self._owner]
        if not entries:
            return {}, {}
        owners = [self._owner[e.request_id] for e in entries]
        rows = [
            SampleRow(s.params, c.seq.prompt_token_ids, c.seq.output_token_ids, c.generator)
            for s, c in owners
        ]
        out = sample(_rows(logits, [e.sample_row for e in entries]), rows, self.rng)
        sampled, stopped = {}, {}
        for i, (state, c) in enumerate(owners):
            token = int(out.token_ids[i])
            sampled[c.seq.request_id] = token
            if c.logprobs is not None:
                c.logprobs.append(self._decorate(out.logprobs[i]))
                c.cumulative_logprob += out.sampled_logprobs[i]
            if self._stops(state, c, token):
                stopped[c.seq.request_id] = SequenceStatus.FINISHED_STOPPED
            if state.first_token_time is None:
                state.first_token_time = time.monotonic()
            touched[state.request_id] = state
        return sampled, stopped

    def _stops(self, state: RequestState, c: Completion, token: int) -> bool:
        """Detokenize the new token and apply the stop rules; True if it stops the sequence."""
        new_text = c.detok.add(token)
        if c.detok.stopped is not None:
            c.finish_reason, c.stop_reason = "stop", c.detok.stopped
            return True
        ids = [*c.seq.output_token_ids, token]
        decision = check_stop(
            ids,
            c.detok.text,
            len(new_text),
            state.params,
            self.eos_token_ids,
            self.max_model_len,
            len(state.prompt_token_ids),
        )
        if decision is None:
            return False
        c.finish_reason, c.stop_reason = decision.finish_reason, decision.stop_reason
        return decision.finish_reason == "stop"

    def _finish(self, c: Completion, reason: str | None) -> None:
        if c.finish_reason is None:
            c.finish_reason = reason
        if c.detok.stopped is None:
            c.detok.finish()
        aid = c.seq.adapter_id
        if aid is not None:
            self._adapter_users[aid] -= 1

    def _retire(self, state: RequestState) -> RequestOutput:
        """Forget a finished (or aborted) request; unload adapters it was the last user of."""
        for c in state.completions:
            if self._owner.pop(c.seq.request_id, None) is not None:
                self._finish(c, "abort")
        self.requests.pop(state.request_id, None)
        self._finish_drains()
        return state.output()

    def _decorate(self, lp: PositionLogprobs) -> PositionLogprobs:
        for token, entry in lp.items():
            entry.decoded_token = self.tokenizer.decode([token])
        return lp

    # ---- introspection ----------------------------------------------------------------------

    def stats(self) -> dict:
        """Counts for /metrics: requests, pool pages by use, per-adapter residency/counters."""
        sched = self.scheduler.stats()
        pool = self.pool.stats()
        cached = set(self.registry.cached_ids())
        adapters = {}
        for r in self.list_loras():
            aid = r.lora_int_id
            where = "device" if self.pool.is_resident(aid) else "host" if aid in cached else "none"
            counters = self.pool.adapter_counters.get(aid, {})
            adapters[r.lora_name] = {
                "resident": where,
                **{k: counters.get(k, 0) for k in ("loads", "evictions", "hits", "misses")},
            }
        return {
            "running": sched.num_running,
            "waiting": sched.num_waiting,
            "preemptions": sched.num_preemptions,
            "pool": {
                "kv": pool.kv_pages,
                "free": pool.free_pages,
                "adapter": pool.adapter_pages_pinned + pool.adapter_pages_idle,
            },
            "adapters": adapters,
            "step": self.times,
        }


def _rows(logits: np.ndarray, rows: list[int]) -> np.ndarray:
    """logits[rows] without a copy when rows are 0..n-1 in order (every decode step)."""
    if rows == list(range(len(rows))):
        return logits[: len(rows)]
    return logits[rows]
