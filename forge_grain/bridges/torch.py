"""forge-grain's pipeline as a PyTorch `IterableDataset`, with two ways to resume.

    ds = GrainIterableDataset(config)                      # rank/world size from torch.distributed
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=2, pin_memory=True)

Each element is one whole per-rank batch (hence `batch_size=None`). With `num_workers=W`,
worker w produces steps w, w + W, ..., so the DataLoader's round-robin over workers yields
the steps in order: no batch missing or repeated, whatever W. Streaming sources allow any W
dividing the config's `canonical_workers`: worker w reads only the canonical streams of its
steps (see `forge_grain.sources.streaming`), and each batch carries their positions
(`stream_states`) for the tracker.

Resuming:

1. **Same cluster, same workers** — torchdata's `StatefulDataLoader` convention: each
   worker's `state_dict()` is its own next step; `loader.state_dict()` /
   `loader.load_state_dict()` resume exactly. torchdata 0.11 refuses to load a state saved
   under another `num_workers` (an AssertionError), and each worker knows only its own
   progress, so this path cannot change the worker count or world size.
2. **Any cluster, any workers** — `tracker = ds.tracker()`, `tracker.update(batch)` for each
   batch the training loop consumed; `tracker.state_dict()` is the next global step plus the
   pipeline fingerprint, the same on every rank. It is a `torch.distributed.checkpoint`
   `Stateful`; loading it (`tracker.load_state_dict`) before iterating makes the loader
   continue with the next global batch at any world size and worker count.

Grain's `mp_prefetch` cannot start inside DataLoader workers (daemonic processes have no
children): here the parallelism is the DataLoader's workers; use `Pipeline(worker_count=N)`
only when iterating the pipeline directly.
"""

from __future__ import annotations

import json
import sys
import warnings

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from forge_grain import DataConfig, Pipeline, StateError, merge_states
from forge_grain.sources.streaming import START
from forge_grain.packing.varlen import varlen
from forge_grain.pipeline.live import adopting
from forge_grain.processes import exit_with_parent

from forge_grain.bridges.torch_channel import ResumeChannel
from forge_grain.bridges.torch_slots import check_socket_dir, worker_ring

# torchdata's StatefulDataLoader (the loader this bridge is made for) calls a torch API
# torch has deprecated, on every iter(): a warning per epoch its user cannot act on
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)

CONVENTIONS = ("forge", "hf")
IGNORE_INDEX = -100


def _rank_and_world(rank, world_size) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def to_torch(batch: dict, convention: str = "forge", dtype: torch.dtype = torch.int64) -> dict:
    """A pipeline batch as torch tensors, in forge-grain's or Hugging Face's convention."""
    def ids(a):
        t = torch.from_numpy(np.ascontiguousarray(a))
        return t if t.dtype == dtype else t.to(dtype)  # the pipeline made it in `dtype`: no call

    out = {"source_id": ids(batch["source_id"]), "step": torch.from_numpy(np.array(batch["step"], np.int64))}
    if convention == "forge":
        for k in ("inputs", "targets", "segment_ids", "positions"):
            out[k] = ids(batch[k])
        out["loss_mask"] = torch.from_numpy(batch["loss_mask"])
        out["natural_stop"] = torch.from_numpy(batch["natural_stop"])
        return out
    inputs = batch["inputs"]
    out["input_ids"] = ids(inputs)
    out["labels"] = torch.from_numpy(hf_labels(inputs, batch["loss_mask"])).to(dtype)
    out["attention_mask"] = ids(batch["segment_ids"] > 0)
    out["position_ids"] = ids(batch["positions"])
    out["segment_ids"] = ids(batch["segment_ids"])  # documents within rows, for the attention helpers
    stop = np.zeros(inputs.shape, np.bool_)  # aligned with labels: true where the label ends its document
    stop[:, 1:] = batch["natural_stop"][:, :-1]
    out["is_natural_stop"] = torch.from_numpy(stop)
    return out


def hf_labels(inputs: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """Hugging Face labels: aligned with the inputs (the model shifts them), -100 where the
    loss mask is 0 (so at each document's first token, and at each row's first)."""
    labels = np.full(inputs.shape, IGNORE_INDEX, np.int64)
    labels[:, 1:] = np.where(loss_mask[:, :-1], inputs[:, 1:], IGNORE_INDEX)
    return labels


class GrainIterableDataset(IterableDataset):
    """Per-rank batches of a forge-grain `Pipeline` (or `DataConfig`) as dicts of tensors.

    convention: "forge" (inputs, targets, segment_ids, positions, loss_mask) or "hf"
    (input_ids, labels with -100 where the loss mask is 0, attention_mask, position_ids,
    segment_ids); both add source_id and step. `varlen=True` adds `cu_seqlens`, `max_seqlen` and
    `doc_lens` (`forge_grain.packing.varlen`; padded to `max_segments_per_row + 1` segments a row
    when the config caps them, else `seq_len`). `rows=True` yields the rows of each batch one
    at a time, for trainers that batch themselves (Hugging Face `Trainer` with
    `per_device_train_batch_size` = the per-rank batch, `global_batch_size / world_size`:
    every DataLoader batch is then one pipeline step, with any worker count); `len()` then
    counts rows. dtype: of ids and positions (int64 suits embedding
    lookups; int32 on request). A full pass covers the pipeline's steps; a new pass
    (a new DataLoader epoch) starts again at step 0, so for several shuffled passes set
    `num_epochs` in the config.
    """

    def __init__(self, source: Pipeline | DataConfig, *, rank: int | None = None, world_size: int | None = None,
                 convention: str = "forge", dtype: torch.dtype = torch.int64, cache_dir=None, varlen: bool = False,
                 rows: bool = False):
        if convention not in CONVENTIONS:
            raise ValueError(f"convention must be one of {CONVENTIONS}, not {convention!r}")
        if rows and varlen:
            raise ValueError("varlen metadata describes whole batches: use rows=False with varlen=True")
        if isinstance(source, Pipeline):
            if rank is not None and (rank, world_size) != (source.shard_index, source.shard_count):
                raise ValueError("the pipeline was built for another rank or world size")
            self.pipeline = source
        else:
            rank, world_size = _rank_and_world(rank, world_size)
            np_dtype = torch.empty(0, dtype=dtype).numpy().dtype  # batches come out in it: no conversion pass
            self.pipeline = Pipeline(source, rank, world_size, num_threads=0, prefetch=0, cache_dir=cache_dir,
                                     dtype=np_dtype)
        if rows and not self.pipeline.batches.constant:
            raise ValueError("rows=True is for trainers that batch rows at one fixed size; under a batch-size "
                             "schedule (batch_sizes, batch_ramp) yield whole batches (rows=False)")
        self.convention, self.dtype, self.varlen, self.rows = convention, dtype, varlen, rows
        self._resume: dict | None = None  # a per-worker state: applies to the next pass of this process only
        self._channel = ResumeChannel()  # a global (tracker) state: applies to the next pass, wherever it runs
        self._next_step: int | None = None  # next step this process will produce
        self._end = 0  # the end of the pass it is making
        self._num_workers = 1
        self._changes = 0  # live weight changes this copy of the pipeline has made (`set_weights`)
        self._last_made: int | None = None

    @property
    def num_steps(self) -> int | None:
        return self.pipeline.num_steps

    @property
    def steps_per_pass(self) -> int:
        """Steps of one DataLoader pass: one epoch of the pipeline (`steps_per_epoch`), or all of
        its steps when it has less than an epoch or only `max_steps`. With `num_epochs = E`
        the pipeline has exactly E · steps_per_epoch steps, so E passes tile it: a trainer
        configured for E epochs sees every step (a fractional E leaves a shorter last pass).
        Under a batch-size schedule epochs are not the same number of steps: one pass is
        all the steps."""
        p, epochs = self.pipeline, self.pipeline.config.num_epochs
        if epochs is None or not p.batches.constant:
            if p.num_steps is None:
                raise TypeError("an unlimited pipeline has no length: set num_epochs or max_steps")
            return p.num_steps
        return min(p.steps_per_epoch, p.num_steps)

    def __len__(self) -> int:
        """This rank's exact number of batches in one pass (what a trainer's schedule needs); of
        rows with `rows=True`."""
        return self.steps_per_pass * (self.pipeline.local_batch_size if self.rows else 1)

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass cover pipeline steps [epoch·n, (epoch+1)·n), n = `len(self)`, so
        trainers that call `set_epoch` (Hugging Face `Trainer`, Lightning) see the pipeline's
        next epoch instead of a replay. Without it every pass starts at step 0. DataLoader
        workers see it too, persistent ones included (it travels through the resume channel)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, not {epoch!r}")
        self._channel.set_epoch(epoch)

    def _pass_start(self) -> int:
        """The first step of the pass `set_epoch` chose."""
        epoch = self._channel.epoch()
        if self.pipeline.num_steps is None:  # unlimited: one endless pass
            if epoch:
                raise StateError("an unlimited pipeline has one endless pass; set_epoch needs num_epochs or max_steps")
            return 0
        start = epoch * self.steps_per_pass
        if start >= self.pipeline.num_steps:
            raise StateError(
                f"epoch {epoch} starts at step {start}, past the pipeline's {self.pipeline.num_steps} steps; "
                "raise num_epochs (or max_steps) in the config"
            )
        return start

    def _pass_end(self, step: int) -> int:
        """The end of the pass that holds `step` (so a resumed pass runs to its own end)."""
        if self.pipeline.num_steps is None:
            return sys.maxsize
        n = self.steps_per_pass
        return min((step // n + 1) * n, self.pipeline.num_steps)

    def _worker(self) -> tuple[int, int]:
        info = get_worker_info()
        return (info.id, info.num_workers) if info is not None else (0, 1)

    def _first_step(self, w: int, W: int) -> tuple[int, int]:
        """(the first step this process makes in this pass, the pass's end), its streams positioned
        for it: from a loaded state, else the pass start `set_epoch` chose."""
        state, self._resume = self._resume, None
        posted = self._channel.take(W)
        return self._start(state if posted is None else posted, w, W, posted=posted is not None)

    def _start(self, state: dict | None, w: int, W: int, posted: bool) -> tuple[int, int]:
        """(the first step, the pass's end) of worker `w` of `W` starting a pass from `state` (a
        per-worker one, a posted global one, or None: the pass start `set_epoch` chose), its
        streams positioned for it."""
        if posted:  # (a persistent worker made before a state with weights set live was loaded)
            self.pipeline = adopting(self.pipeline, state)
        streams = None
        if state is None:
            start = self._pass_start()
            first, end = start + w, self._pass_end(start)
            if self.pipeline.streams:
                streams = self._streams_at(start)
        elif state.get("kind") == "worker":
            if state["num_workers"] != W:
                raise StateError(
                    f"a per-worker state saved with {state['num_workers']} workers cannot resume {W}; "
                    "use the tracker's global state to change the worker count"
                )
            first, streams = int(state["next_step"]), state.get("pipeline", {}).get("streams")
            # the pass it was saved in (a worker whose next step is past it has finished that pass)
            end = int(state["pass_end"]) if "pass_end" in state else self._pass_end(first - w)
        else:
            first, streams = int(state["step"]) + w, state.get("streams")
            end = self._pass_end(int(state["step"]))
        if self.pipeline.streams:
            self.pipeline.start_streams(first, W, streams)  # its steps' canonical streams only
        return first, end

    def _streams_at(self, start: int) -> list | None:
        """The streams' positions at pass start `start`: handed over by the last pass's processes,
        or known in this one (None: reached by reading)."""
        return self._channel.handed_over(start) or self.pipeline.known_streams(start)

    def __iter__(self):
        if get_worker_info() is not None:
            exit_with_parent()  # a worker outliving a killed training process would hold its memory and locks
            check_socket_dir()
        w, W = self._worker()
        self._num_workers = W
        step, end = self._first_step(w, W)
        self._next_step, self._end = step, end
        self._last_made = None  # the last step this process made in this pass
        while step < end:
            self._apply_changes(step)
            batch = self._tensors(self.pipeline.batch(step))
            self._last_made = step
            if self.pipeline.streams:  # where this worker's streams are now, for the tracker
                batch["stream_states"] = _encode(self.pipeline.stream_positions(step + W))
            step += W
            self._next_step = step
            if self.rows:  # one row at a time, for trainers that batch (the step's rows, in order)
                yield from ({k: v if v.dim() == 0 else v[i] for k, v in batch.items() if k != "stream_states"}
                            for i in range(self.pipeline.local_batch_size))
            else:
                yield self._sent(batch, self._growth(step - W)) if get_worker_info() is not None else batch
            # hold no batch while making the next: the pool then refills the block the caller just
            # released (still in the CPU's cache) instead of a third one (a quarter of the rate)
            del batch
        if self.pipeline.streams and end < self.pipeline.step_limit:
            # the pass is done here: hand this process's streams to whichever processes start the next
            self._channel.hand_over(end, self.pipeline.stream_positions(step))

    def set_weights(self, weights, at_step: int) -> None:
        """Mix with `weights` (by source name, or a list in source order) from global step
        `at_step` on, without repeating or skipping a row (`Pipeline.with_weights`). Every rank
        calls it with the same arguments (the tracker's state then checks that they did).
        DataLoader workers make batches ahead: with workers, give a step past those already
        made (the steps in flight: about num_workers × prefetch_factor past the last batch
        consumed); a worker that made step `at_step` with the old weights raises an error
        naming both steps."""
        if self._last_made is not None and isinstance(at_step, int) and at_step <= self._last_made:
            raise StateError(f"set_weights at step {at_step}: step {self._last_made} was already made")
        self.pipeline = self.pipeline.with_weights(weights, at_step)
        self._changes = self._channel.add_change(at_step, self.pipeline._live)

    def _apply_changes(self, step: int) -> None:
        """Make the weight changes posted since this copy last looked (a worker's copy)."""
        changes = self._channel.changes()
        for at_step, weights in changes[self._changes:]:
            if self._last_made is not None and at_step <= self._last_made:
                raise StateError(f"set_weights(at_step={at_step}) reached a DataLoader worker after it made step "
                                 f"{self._last_made} with the old weights: change the weights at a step past the "
                                 "batches in flight (num_workers × prefetch_factor past the last one consumed)")
            self.pipeline = self.pipeline.with_weights(weights, at_step)
        self._changes = len(changes)

    @staticmethod
    def _sent(batch: dict, growth: float = 1.0) -> dict:
        """In a DataLoader worker: the batch in a reused shared-memory slot (`forge_grain.bridges.torch_slots`),
        its slots made `growth` times this batch (the largest batch of a batch-size schedule)."""
        ring = worker_ring(batch, growth)
        return ring.send(batch) if ring is not None else batch

    def _growth(self, step: int) -> float:
        """How many times step `step`'s batch the largest batch is (most rows, longest rows)."""
        p = self.pipeline
        longest = max(n for _, n in p.order.seq_lens)
        return max(p.batches.sizes_used) * longest / (p.batches.size(step) * p.order.seq_len_at(step))

    def _tensors(self, batch: dict) -> dict:
        out = to_torch(batch, self.convention, self.dtype)
        if self.varlen:
            cap = self.pipeline.config.max_segments_per_row
            meta = varlen(batch, cap + 1 if cap else None)  # K documents and a padding run
            out.update(cu_seqlens=torch.from_numpy(meta["cu_seqlens"]), max_seqlen=meta["max_seqlen"],
                       doc_lens=torch.from_numpy(meta["doc_lens"]))
        return out

    # -- path 1: StatefulDataLoader (per worker, same worker count) --------------------------

    def state_dict(self) -> dict:
        if self._next_step is None and self._resume is not None:
            return dict(self._resume)
        w, W = self._worker()
        if self._next_step is None:  # not started (StatefulDataLoader asks first): where its pass will start
            posted = self._channel.peek(W)
            next_step, end = self._start(posted, w, W, posted=posted is not None)
        else:
            next_step, end = self._next_step, self._end
        state = {"kind": "worker", "next_step": next_step, "pass_end": end, "num_workers": W,
                 "fingerprint": self.pipeline.fingerprint}
        if self.pipeline.streams:  # their positions, which only this process knows
            p = self.pipeline  # (a worker past the end has finished: its state stands at the run's end)
            state["pipeline"] = p.make_state(min(next_step, p.step_limit), p.stream_positions(next_step))
        elif self.pipeline._live is not None:  # weights set live: what a fresh process rebuilds it from
            state["pipeline"] = self.pipeline.state_at(min(next_step, self.pipeline.step_limit))
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") == "worker":  # StatefulDataLoader hands each worker its own
            if isinstance(state.get("pipeline"), dict):
                self.pipeline = adopting(self.pipeline, state["pipeline"])  # a state with weights set live
            if state.get("fingerprint") != self.pipeline.fingerprint:
                raise StateError("this state was saved by a pipeline with another config or other data")
            w, W = self._worker()
            step = state.get("next_step")
            if self.pipeline.streams and state.get("num_workers") == W and isinstance(step, int):
                self.pipeline.start_streams(step, W, state.get("pipeline", {}).get("streams"))  # the streams it holds
            inner = state.get("pipeline") or self.pipeline.make_state(0)  # (its step replaced below)
            if isinstance(step, int) and not isinstance(step, bool):  # a worker past the end has finished
                step = min(step, self.pipeline.step_limit)
            self.pipeline.check_state({**inner, "step": step})  # types, range, streams
            self._resume = dict(state)
        else:
            self.pipeline = adopting(self.pipeline, state)  # a state with weights set live
            self.pipeline.check_state(state)
            self._channel.post({**state, "kind": "global"})
        self._next_step = None

    # -- path 2: the global step (any world size, any workers) --------------------------------

    def tracker(self) -> "StepTracker":
        return StepTracker(self)


def _encode(obj) -> torch.Tensor:
    """JSON as a uint8 tensor: every value of a batch stays a tensor (`.to(device)` works)."""
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def _decode(t: torch.Tensor):
    return json.loads(t.cpu().numpy().tobytes().decode())


class StepTracker:
    """What the training loop consumed, as a world-size- and worker-independent state.

    A `torch.distributed.checkpoint.stateful.Stateful`: `state_dict()` is
    {"step": next global step, "fingerprint": ..., ...}, identical on every rank.
    With streaming sources it also holds their canonical streams' positions: each batch
    carries those of the streams its worker read (`stream_states`, JSON as a uint8 tensor), and `state_dict()`
    joins the ranks' (`all_gather_object`, when torch.distributed is initialized), so the
    state resumes on any world size dividing `canonical_streams` and any worker count
    dividing `canonical_workers`. Once the run has set weights live (`set_weights`, here or in
    the run its state came from), `state_dict()` is a collective too (call it on every rank):
    it checks that every rank made the same changes.
    """

    def __init__(self, dataset: GrainIterableDataset):
        self.dataset = dataset
        self.next_step = 0
        p = dataset.pipeline
        owned = p.layout.owned(p.shard_index, p.shard_count) if p.streams else []
        self._streams = [{str(c): dict(START) for c in owned} for _ in p.streams]

    def update(self, batch: dict) -> None:
        """Record that the training loop consumed `batch`."""
        self.next_step = int(batch["step"]) + 1
        if "stream_states" in batch:
            for mine, seen in zip(self._streams, _decode(batch["stream_states"])):
                mine.update(seen)

    def state_dict(self) -> dict:
        p = self.dataset.pipeline
        if not p.streams:
            state = p.state_at(self.next_step)
            if "live" in state["config"]:  # weights set live: every rank must have made the same changes
                _check_same_on_every_rank(state["fingerprint"])
            return state
        state = p.make_state(self.next_step, [dict(s) for s in self._streams])
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            states = [None] * dist.get_world_size()
            dist.all_gather_object(states, state)
            state = merge_states(states)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next pass of the dataset starts at `state['step']`, whatever the worker
        count, and also when the loader's workers are persistent and already running; the pass
        after it starts where `set_epoch` puts it."""
        self.dataset.pipeline = p = adopting(self.dataset.pipeline, state)  # a state with weights set live
        self.next_step = p.check_state(state)
        if p.streams:
            owned = {str(c) for c in p.layout.owned(p.shard_index, p.shard_count)}
            self._streams = [{c: st for c, st in per.items() if c in owned} for per in state["streams"]]
        self.dataset.load_state_dict(state)


def source_losses(token_losses: torch.Tensor, source_id: torch.Tensor, loss_mask: torch.Tensor,
                  num_sources: int) -> torch.Tensor:
    """Each source's mean loss over the batch's trained tokens ([num_sources], NaN where a
    source has none), on the losses' device; see `forge_grain.pipeline.live.source_losses`.
    Under data parallelism, all-reduce the sums instead: this is one rank's batch."""
    mask = loss_mask.to(token_losses.dtype)
    ids = source_id.to(token_losses.device).long()
    total = torch.zeros(num_sources, dtype=token_losses.dtype, device=token_losses.device)
    count = torch.zeros_like(total)
    total.index_add_(0, ids, (token_losses * mask).sum(dim=1))
    count.index_add_(0, ids, mask.sum(dim=1))
    return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, float("nan")))


def _check_same_on_every_rank(fingerprint: str) -> None:
    """A StateError on every rank when the ranks' pipelines differ (a collective)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        prints = [None] * dist.get_world_size()
        dist.all_gather_object(prints, fingerprint)
        differ = [r for r, f in enumerate(prints) if f != prints[0]]
        if differ:
            raise StateError(f"ranks {differ} set other weights than rank 0 (set_weights must be called with the "
                             "same arguments on every rank): their batches follow no single mixture")


class DeviceLoader:
    """Batches on `device`, the next one's host-to-device copy overlapping this one's compute.

    On CUDA, two sets of pre-allocated device buffers alternate; copies are issued with
    `non_blocking=True` on a side stream from pinned host memory (use the DataLoader's
    `pin_memory=True`), and the compute stream waits only for the batch it is given. A
    yielded batch stays valid until the next-but-one batch is requested. Elsewhere it is
    a plain `.to(device)`.
    """

    def __init__(self, loader, device: str | torch.device):
        self.loader = loader
        self.device = torch.device(device)

    def __iter__(self):
        if self.device.type != "cuda":
            for batch in self.loader:
                yield {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            return
        yield from self._cuda()

    def _cuda(self):
        stream = torch.cuda.Stream(self.device)
        buffers: list[dict] = []
        pending = None  # (buffers, event, host batch kept alive until its copy is done)
        for i, host in enumerate(self.loader):
            tensors = {k: v for k, v in host.items() if torch.is_tensor(v)}
            if len(buffers) < 2:
                buffers.append({k: torch.empty_like(v, device=self.device) for k, v in tensors.items()})
            buf = buffers[i % 2]
            for k, v in tensors.items():  # batches that grow (a batch-size schedule) get buffers of their size
                if k not in buf or buf[k].shape != v.shape:
                    buf[k] = torch.empty_like(v, device=self.device)
            buf.update({k: v for k, v in host.items() if k not in tensors})  # e.g. stream_states: as they are
            stream.wait_stream(torch.cuda.current_stream(self.device))  # compute on buf is done
            with torch.cuda.stream(stream):
                for k, v in tensors.items():
                    buf[k].copy_(v, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            if pending is not None:
                torch.cuda.current_stream(self.device).wait_event(pending[1])
                yield pending[0]
            pending = (buf, event, host)
        if pending is not None:
            torch.cuda.current_stream(self.device).wait_event(pending[1])
            yield pending[0]
