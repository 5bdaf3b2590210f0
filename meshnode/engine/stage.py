"""One loaded layer range (a *slice*, or a whole model) on llama.cpp.

Theory of operation
-------------------
A slice GGUF holds blocks [a, b) of a model renumbered from 0 (see meshnode.models.slicer).
The first stage feeds token ids; later stages feed the previous stage's hidden states
through ``batch.embd``. A non-final stage reads the residual stream after its last layer
(``l_out-{n_layer-1}``) with a :class:`~meshnode.engine.ggml.LayerTap` and stops the graph
there; a final stage returns logits, computed only for the rows that will be sampled.
Chaining slices this way is bit-identical to the whole model (docs/engine.md) provided:

* every row of a non-final stage is marked as an output (llama.cpp prunes the last
  layer to output rows otherwise, and an unmarked row never reaches ``l_out``);
* ``n_ubatch == n_batch`` (the tap fires once per ubatch);
* each llama_decode call is one micro-batch whose rows come back in batch order (one KV
  stream per session: consecutive sequence ids, the same row count each; :meth:`_calls`);
* every participant uses the same batch schedule (verify windows <= 32).

Sessions are caller-chosen integers mapped onto llama.cpp sequence ids. Positions are
explicit; the engine tracks each session's next position and refuses gaps, so a caller
must :meth:`rollback` before re-decoding rejected positions.

Every method blocks (llama_decode): call them on the process's one compute thread
(:class:`meshnode.engine.worker.EngineWorker`), never from the event loop.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import llama_cpp

from .errors import (
    ContextOverflowError,
    DecodeError,
    EngineBusyError,
    EngineInputError,
    ModelLoadError,
)
from .threads import ThreadGovernor
from meshnode import timeline
from meshnode.gguf_files import model_size
from meshnode.state import StageInfo
from meshnode.limits import (
    CPU_PAD_ROWS_ENV,
    DEFAULT_KV_TYPE,
    GPU_STICKY_CALLS,
    KV_CACHE_TYPES,
    MAX_VERIFY_WINDOW,
    adapt_threads,
    cpu_pad_rows,
    gpu_exact_window_rows,
    gpu_pad_rows,
    gpu_sticky_calls,
    kv_bucket,
)

from . import offload
from .callshape import CallShapeTimes, time_call_shapes
from .ggml import LayerTap
from .llama_log import install_log_bridge

log = logging.getLogger(__name__)

# the session id of the steps an engine times before any session exists (_scratch_step)
_SCRATCH_SESSION = -1

# ggml_type of each KV cache type a stage may be asked for (wire Load.kv_type).
KV_TYPES = {"q8_0": 8, "f16": 1, "bf16": 30, "f32": 0}
assert set(KV_TYPES) == set(KV_CACHE_TYPES)


@dataclass(frozen=True, slots=True)
class Segment:
    """Rows of one session to run in one engine call.

    Exactly one of ``tokens`` (int32, shape (n,)) or ``hidden`` (float32, shape
    (n, n_embd)) is set. ``n_logits``: on a final stage, how many trailing rows to return
    logits for (0 = none, e.g. a prefill chunk that is not the last).
    """

    session: int
    pos: int
    tokens: np.ndarray | None = None
    hidden: np.ndarray | None = None
    n_logits: int = 0

    @property
    def n_rows(self) -> int:
        data = self.tokens if self.tokens is not None else self.hidden
        return 0 if data is None else int(data.shape[0])


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How to load a stage. ``takes_tokens``: slice holds the token embedding (first
    stage or whole model). ``has_head``: slice ends with norm + lm_head (final stage or
    whole model)."""

    path: Path
    takes_tokens: bool = True
    has_head: bool = True
    n_ctx: int = 2048          # per session
    n_batch: int = 256         # rows per llama_decode (also n_ubatch)
    n_seq_max: int = 4         # concurrent sessions
    n_threads: int | None = None
    # Threads for one-token batches (None: n_threads). With the default KV type the thread
    # counts do not change any result; with an f16/f32 KV cache, 1 keeps one-row steps equal
    # to verify windows past 512 cells (docs/speculative.md, "Exactness").
    decode_threads: int | None = None
    # Adapt the thread count, within 1..n_threads, to the cores the machine has free
    # (engine/threads.py). None: on (unless $MESHNODE_ADAPT_THREADS=0) where no count
    # changes a result: a CPU engine with the q8_0 KV cache and one count for all calls.
    adapt_threads: bool | None = None
    # Layers to offload to a GPU: a count, offload.GPU_LAYERS_ALL, or GPU_LAYERS_AUTO (as
    # many as the free VRAM holds). Resolved to 0 on a build without a GPU device.
    gpu_layers: int = 0
    # Flash attention: None is on for a CPU stage (with the q8_0 KV cache, below, it is what
    # makes rows batch-invariant) and off when layers are offloaded to a GPU (CUDA's flash
    # attention picks kernels by row count, so verify windows would not reproduce one-row
    # steps); True / False force it.
    flash_attn: bool | None = None
    # Run a lone segment of fewer rows as this many (the extra rows throwaway copies, rolled
    # back at once), so that one-row steps and verify windows up to this width all take the
    # same kernels. None: limits.gpu_pad_rows() (2 unless set) when layers are offloaded
    # to a GPU, where llama.cpp picks its matmul kernels by row count and each rounds
    # differently, else 1 (no padding; docs/engine.md, "GPU").
    pad_rows: int | None = None
    taps: tuple[int, ...] = ()  # extra layers to capture (certification)
    # Exactness (docs/engine.md, "Batch invariance"): one KV stream per session, so a
    # session's keys sit in cells 0..n of its own stream whatever its neighbours do; and a
    # q8_0 KV cache, on which llama.cpp's CPU flash attention computes every (row, head)
    # whole on one thread, visiting the session's cells in order. With an f16 or f32 cache
    # it would split a lone row's KV over the threads (once 512+ cells) and tile batches of
    # 32+ rows, each rounding differently; without flash attention, K.Q of a multi-row
    # batch goes through llamafile's tiled GEMM and a single row does not. So a row's
    # result depends neither on its neighbours, nor on the batch size, nor on threads.
    kv_unified: bool = False
    kv_type: str = DEFAULT_KV_TYPE
    # Move the sessions of one call onto consecutive sequence ids first (_pack), so that
    # llama.cpp computes them in one micro-batch. None: on a CPU engine that does not pad
    # (not on a GPU engine, nor on a CPU engine taking the GPU's call paths). With the KV
    # on a GPU a move costs far more than the calls it saves: llama.cpp reserves a new
    # worst-case graph at the next decode after a stream copy, and a swap through host
    # memory copies whole streams out and back; on an H200 such steps held the event loop
    # 0.1-1.5 s (docs/engine.md, "Sessions together").
    pack_sessions: bool | None = None


def _peek_shape(path: Path, n_cells: int) -> tuple[int, int]:
    """(n_layer, f16 KV bytes per layer for ``n_cells``) from the GGUF header alone (no
    weights are read): what ``--gpu-layers auto`` sizes the offload by. (llama.cpp's
    vocab-only load does not fill the per-layer sizes: asking it aborts.)"""
    from meshnode.gguf_reader import PARSE_ERRORS, BulkReader

    try:
        reader = BulkReader(path)

        def field(key: str, default: int | None = None) -> int:
            f = reader.fields.get(key)
            if f is None:
                if default is None:
                    raise KeyError(key)
                return default
            v = f.contents()
            return int(v[0] if isinstance(v, list) else v)

        arch = reader.fields["general.architecture"].contents()
        n_layer = field(f"{arch}.block_count")
        n_embd = field(f"{arch}.embedding_length")
        n_head = max(1, field(f"{arch}.attention.head_count", 1))
        n_head_kv = field(f"{arch}.attention.head_count_kv", n_head) or n_head
    except (*PARSE_ERRORS, OSError) as exc:
        raise ModelLoadError(f"cannot read the layer sizes of {path.name}: {exc}") from None
    return n_layer, 2 * 2 * (n_embd * n_head_kv // n_head) * n_cells


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def stage_threads(requested: int | None, gpu_layers: int, n_layer: int) -> int:
    """llama.cpp's CPU threads for a stage: ``requested``, else every core, except that a
    stage with every layer and its head on the GPU (``gpu_layers > n_layer``) gets 1. The
    CPU then does little more than the token embedding lookup, and a step computed on one
    CPU thread runs inline on the event loop instead of paying the hand-off to the
    compute thread and back (engine/worker.py)."""
    if requested:
        return requested
    return 1 if gpu_layers > n_layer else default_threads()


class StageEngine:
    """A loaded slice with its own llama.cpp context. Use as a context manager or close()."""

    def __init__(self, config: EngineConfig) -> None:
        install_log_bridge()
        self.config = config
        self._model = None
        self._ctx = None
        path = Path(config.path)
        if not path.is_file():
            raise ModelLoadError(f"model file not found: {path}")
        if config.n_batch < 1 or config.n_ctx < 1 or config.n_seq_max < 1:
            raise EngineInputError("n_batch, n_ctx and n_seq_max must be positive")
        if config.kv_type not in KV_TYPES:
            raise EngineInputError(f"unknown KV cache type {config.kv_type!r} (one of {', '.join(KV_TYPES)})")

        offload.backend_env_defaults()
        self.gpu_layers = offload.resolve_gpu_layers(
            config.gpu_layers, file_bytes=model_size(path),   # (every part of a split model)
            shape=lambda: _peek_shape(path, config.n_ctx * config.n_seq_max))
        self.backend = offload.backend_summary()[0] if self.gpu_layers else "cpu"
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = self.gpu_layers
        # No "extra" weight buffers (llama.cpp's CPU repacking and AMX tiles). On a VM whose
        # CPU advertises AMX without the hypervisor enabling its tile state, the AMX matmul
        # faults on its first `ldtilecfg` and takes the process down (seen on Sapphire
        # Rapids VMs); and a repacked layout is one more kernel choice that could differ
        # between the nodes of a split. Plain buffers are exact everywhere.
        mparams.use_extra_bufts = False
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise ModelLoadError(f"llama.cpp could not load {path} (not a valid GGUF model?)")
        self._model = model
        if llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model):
            self.close()
            raise ModelLoadError(f"{path.name}: recurrent/hybrid models cannot roll back KV; not supported")

        self.n_embd = int(llama_cpp.llama_model_n_embd(model))
        self.n_layer = int(llama_cpp.llama_model_n_layer(model))
        self.gpu_layers = min(self.gpu_layers, self.n_layer + 1)   # what llama.cpp offloads
        log.info("%s: --gpu-layers %s, %d layer(s) offloaded (%s)", path.name,
                 {offload.GPU_LAYERS_AUTO: "auto", offload.GPU_LAYERS_ALL: "all"}.get(
                     config.gpu_layers, config.gpu_layers), self.gpu_layers, self.backend)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model)))
        self.takes_tokens = config.takes_tokens
        self.has_head = config.has_head
        self.n_batch = config.n_batch
        self.n_ctx = config.n_ctx

        stop = None if config.has_head else self.n_layer - 1
        self._tap = (LayerTap(self.n_embd, config.n_batch, stop, config.taps)
                     if (stop is not None or config.taps) else None)

        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = config.n_ctx * config.n_seq_max
        cparams.n_batch = config.n_batch
        cparams.n_ubatch = config.n_batch
        cparams.n_seq_max = config.n_seq_max
        threads = stage_threads(config.n_threads, self.gpu_layers, self.n_layer)
        self.n_threads_batch = threads
        self.n_threads_decode = config.decode_threads or threads
        cparams.n_threads = self.n_threads_decode   # llama.cpp: one-token batches
        cparams.n_threads_batch = threads
        cparams.kv_unified = config.kv_unified
        flash = config.flash_attn if config.flash_attn is not None else not self.gpu_layers
        kv_type = config.kv_type
        if not flash and kv_type == "q8_0":
            # llama.cpp quantizes the V cache only with flash attention; a GPU stage runs
            # without it (exact one-row steps there), so it keeps its KV in f16.
            kv_type = "f16"
        n_head = max(1, llama_cpp.llama_model_n_head(model))
        if kv_type == "q8_0" and (self.n_embd // n_head) % 32:
            # q8_0 packs blocks of 32 values: a head narrower than that (small test models)
            # cannot be stored so, and llama.cpp refuses the context. Every stage of a split
            # has the same heads, so they all make the same choice.
            kv_type = "f16"
        self.kv_type = kv_type
        adapts = (config.adapt_threads if config.adapt_threads is not None else adapt_threads())
        exact_any_count = (flash and kv_type == "q8_0" and not self.gpu_layers
                           and config.decode_threads is None)
        self._governor = ThreadGovernor(threads) if adapts and exact_any_count and threads > 1 else None
        self._threads_now = threads    # what llama.cpp computes the next call with
        cparams.type_k = cparams.type_v = KV_TYPES[kv_type]
        cparams.swa_full = True   # exact rollback inside sliding-window layers
        cparams.no_perf = True
        cparams.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash
                                   else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        pad = config.pad_rows if config.pad_rows is not None else (gpu_pad_rows() if self.gpu_layers else cpu_pad_rows())
        if isinstance(pad, bool) or not isinstance(pad, int) or not 1 <= pad <= MAX_VERIFY_WINDOW:
            self.close()
            raise EngineInputError(f"pad_rows must be an integer in [1, {MAX_VERIFY_WINDOW}], got {pad!r}")
        self.pad_rows = pad
        self._wide_rows = gpu_exact_window_rows(pad)   # how wide small calls go (_width)
        self._wide_left = 0      # calls left that stay wide after a window (_width)
        self.call_shapes: CallShapeTimes | None = None   # what _choose_sticky_calls measured
        if self._tap is not None:
            cparams.cb_eval = self._tap.c_callback
            cparams.cb_eval_user_data = self._tap.user_data
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        if not ctx:
            self.close()
            raise ModelLoadError(f"llama.cpp could not create a context for {path.name} "
                                 f"(n_ctx={cparams.n_ctx}; out of memory?)")
        self._ctx = ctx
        self._mem = llama_cpp.llama_get_memory(ctx)
        self._alloc_batch()
        self._seq_of: dict[int, int] = {}     # session -> llama seq id
        self._free_seqs = list(range(config.n_seq_max - 1, -1, -1))
        self._copies_queued = False   # a cross-stream KV copy waits for the next decode
        self._packs = (config.pack_sessions if config.pack_sessions is not None
                       else not self.gpu_layers and pad == 1)
        self._next_pos: dict[int, int] = {}   # session -> next position expected
        # after a window wider than the pad, small calls stay wide this many calls
        self._sticky_calls = self._choose_sticky_calls(path.name)
        if pad > 1 and not self.gpu_layers and config.pad_rows is None:
            log.info("%s: CPU engine padding calls to %d rows ($%s), wide after windows for %d calls",
                     path.name, pad, CPU_PAD_ROWS_ENV, self._sticky_calls)

    # ---- batch buffers (owned by numpy, referenced by one llama_batch struct) ----------

    def _alloc_batch(self) -> None:
        n = self.n_batch
        self._tok = np.zeros(n, dtype=np.int32)
        self._embd = np.zeros((n, self.n_embd), dtype=np.float32) if not self.takes_tokens else None
        self._pos = np.zeros(n, dtype=np.int32)
        self._n_seq_id = np.ones(n, dtype=np.int32)
        self._seq_store = np.zeros(n, dtype=np.int32)
        self._out_flags = np.zeros(n, dtype=np.int8)
        ptr_t = ctypes.POINTER(llama_cpp.llama_seq_id)
        self._seq_ptrs = (ptr_t * n)(*[
            ctypes.cast(self._seq_store.ctypes.data + 4 * i, ptr_t) for i in range(n)
        ])
        b = llama_cpp.llama_batch()
        if self.takes_tokens:
            b.token = self._tok.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token))
        else:
            b.embd = self._embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        b.pos = self._pos.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_pos))
        b.n_seq_id = self._n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(ptr_t))
        b.logits = self._out_flags.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self._batch = b

    # ---- sessions -----------------------------------------------------------------------

    def _seq(self, session: int) -> int:
        seq = self._seq_of.get(session)
        if seq is None:
            if not self._free_seqs:
                raise EngineBusyError(f"all {self.config.n_seq_max} session slots are in use")
            seq = min(self._free_seqs)    # the lowest: live sessions stay packed (_pack)
            self._free_seqs.remove(seq)
            self._seq_of[session] = seq
            self._next_pos[session] = 0
        return seq

    def _pack(self, sessions: list[int]) -> None:
        """Give the sessions of one forward consecutive sequence ids, moving KV if needed.

        With one KV stream per session llama.cpp computes each run of consecutive ids as
        a micro-batch of its own (``_calls``), so a batch of 4 sessions on ids 0, 2, 5, 7
        costs four one-session calls: 2x the time of ids 0-3 for SmolLM2 on one thread.
        Ids scatter once sessions outlive the requests that made them (sessions kept for
        prefix reuse hold ids between live ones). So the batch's sessions move into the
        window of ids that already holds most of them: a session of the batch outside it
        takes a free id in the window, or trades places with an idle session there
        (:meth:`_swap`). A move copies a whole stream (llama.cpp copies streams whole)
        and drops the old one; cells and their order are unchanged, so is every result.
        An engine that does not pack (EngineConfig.pack_sessions: a GPU engine) leaves the
        ids as they are and pays one micro-batch per run of consecutive ids."""
        if not self._packs or self.config.kv_unified or len(sessions) < 2:
            return
        seqs = sorted(self._seq_of[x] for x in sessions)
        if seqs[-1] - seqs[0] == len(seqs) - 1:
            return
        k, held = len(seqs), set(seqs)
        start = max(range(self.config.n_seq_max - k + 1),
                    key=lambda a: (sum(a <= q < a + k for q in seqs), -a))
        window = range(start, start + k)
        for x in [x for x in sessions if self._seq_of[x] not in window]:
            target = next(t for t in window if t not in held)
            held.discard(self._seq_of[x])
            if target in self._free_seqs:
                self._move(x, target)
            elif not self._swap(x, next(y for y, q in self._seq_of.items() if q == target)):
                return
            held.add(target)

    def _move(self, session: int, seq: int) -> None:
        """Move ``session``'s KV to the free sequence id ``seq``."""
        old = self._seq_of[session]
        llama_cpp.llama_memory_seq_cp(self._mem, old, seq, -1, -1)
        self._copies_queued = True
        llama_cpp.llama_memory_seq_rm(self._mem, old, -1, -1)
        self._free_seqs.remove(seq)
        self._free_seqs.append(old)
        self._seq_of[session] = seq

    def _swap(self, x: int, y: int) -> bool:
        """Trade the sequence ids of sessions ``x`` and ``y``: through a free id when
        there is one, else through host memory (llama_state_seq_get/set_data write each
        sequence's cells in order into an empty stream: the same layout). llama.cpp
        copies a stream's data across streams only at the next decode, so while such a
        copy is queued no stream may be read or rewritten through the host: then False,
        nothing moved."""
        qx, qy = self._seq_of[x], self._seq_of[y]
        if self._free_seqs:
            self._move(y, min(self._free_seqs))
            self._move(x, qy)
            return True
        if self._copies_queued:
            return False
        saved = [self._save(qx), self._save(qy)]
        for q in (qx, qy):
            llama_cpp.llama_memory_seq_rm(self._mem, q, -1, -1)
        for buf, q in zip(saved, (qy, qx)):
            if llama_cpp.llama_state_seq_set_data(self._ctx, buf, len(buf), q) != len(buf):
                raise DecodeError("llama.cpp could not restore a session it moved")
        self._seq_of[x], self._seq_of[y] = qy, qx
        return True

    def _save(self, seq: int) -> ctypes.Array:
        size = llama_cpp.llama_state_seq_get_size(self._ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        if llama_cpp.llama_state_seq_get_data(self._ctx, buf, size, seq) != size:
            raise DecodeError("llama.cpp could not save a session to move it")
        return buf

    def sessions(self) -> list[int]:
        return list(self._seq_of)

    @property
    def copies_queued(self) -> bool:
        """A KV copy across streams waits for the next decode, which then also makes
        llama.cpp reserve a new worst-case graph: a slow call (EngineWorker keeps it off
        the event loop)."""
        return self._copies_queued

    def next_pos(self, session: int) -> int:
        return self._next_pos.get(session, 0)

    def threads_for(self, rows: int) -> int:
        """CPU threads llama.cpp computes a call of ``rows`` rows with, as configured (a
        padded one-row call is a batch of ``pad_rows`` rows). An engine that adapts its
        count (:attr:`threads`) reports the configured one here, so EngineWorker keeps its
        calls on the compute thread at any count: steps that moved between the event loop
        (run inline at 1 thread) and the compute thread took twice as long at 2."""
        return self.n_threads_decode if rows == 1 and self.pad_rows == 1 else self.n_threads_batch

    @property
    def threads(self) -> int:
        """The CPU threads the engine settled on (a try may run a call with another count)."""
        return self._governor.threads if self._governor is not None else self.n_threads_batch

    @property
    def cpu_threads(self) -> tuple[int, int]:
        """(the CPU threads it settled on, the most it may use); (0, 0) on a GPU."""
        return (self.threads, self.n_threads_batch) if self.backend == "cpu" else (0, 0)

    def describe(self, stage: StageInfo) -> StageInfo:
        """``stage`` as the UI shows it when this engine computes it: its backend and its
        :attr:`cpu_threads`."""
        threads, most = self.cpu_threads
        return dataclasses.replace(stage, backend=self.backend, threads=threads, max_threads=most)

    def _set_threads(self, threads: int) -> None:
        """Compute the next calls with ``threads`` CPU threads (the governor's choice)."""
        llama_cpp.llama_set_n_threads(self._ctx, threads, threads)
        self._threads_now = threads

    def rollback(self, session: int, pos: int) -> None:
        """Forget positions >= ``pos`` of ``session`` (rejected draft tokens)."""
        seq = self._seq_of.get(session)
        if seq is None:
            return
        if pos < 0:
            raise EngineInputError(f"rollback position must be >= 0, got {pos}")
        if pos >= self._next_pos[session]:
            return
        if not llama_cpp.llama_memory_seq_rm(self._mem, seq, pos, -1):
            raise DecodeError(f"llama.cpp refused to roll session {session} back to {pos}")
        self._next_pos[session] = pos

    def copy(self, src: int, dst: int, n_pos: int) -> None:
        """Give the new session ``dst`` the KV of ``src`` at positions [0, n_pos): the
        cells are shared (llama_memory_seq_cp), not duplicated, and either session may
        then roll back or grow on its own. Raises EngineInputError for an unknown
        ``src``, a ``dst`` already in use or ``n_pos`` past what ``src`` holds;
        EngineBusyError when no sequence slot is free."""
        src_seq = self._seq_of.get(src)
        if src_seq is None:
            raise EngineInputError(f"session {src} holds no KV to copy")
        if dst in self._seq_of:
            raise EngineInputError(f"session {dst} is already in use")
        if not 0 <= n_pos <= self._next_pos[src]:
            raise EngineInputError(f"cannot copy {n_pos} positions of session {src} "
                                   f"(it holds {self._next_pos[src]})")
        seq = self._seq(dst)
        if n_pos:
            if self.config.kv_unified:
                llama_cpp.llama_memory_seq_cp(self._mem, src_seq, seq, 0, n_pos)
            else:
                # One KV stream per session: llama.cpp copies only a whole stream across
                # streams (a partial range aborts the process), so copy it all and drop
                # what lies past n_pos.
                llama_cpp.llama_memory_seq_cp(self._mem, src_seq, seq, -1, -1)
                self._copies_queued = True   # its data moves at the next decode
                if n_pos < self._next_pos[src]:
                    llama_cpp.llama_memory_seq_rm(self._mem, seq, n_pos, -1)
        self._next_pos[dst] = n_pos

    def drop(self, session: int) -> None:
        """Free a session's KV cells and its sequence slot."""
        seq = self._seq_of.pop(session, None)
        self._next_pos.pop(session, None)
        if seq is not None:
            llama_cpp.llama_memory_seq_rm(self._mem, seq, -1, -1)
            self._free_seqs.append(seq)

    def reset(self) -> None:
        """Drop every session: the engine as a fresh load would leave it, for a new owner
        (:mod:`meshnode.engine.shelf`). The same as the drops a long-lived stage makes
        whenever its sessions end; its results never depended on earlier sessions
        (each session's KV is a stream of its own, cells 0..n: ``EngineConfig``)."""
        for session in list(self._seq_of):
            self.drop(session)
        self._free_seqs = list(range(self.config.n_seq_max - 1, -1, -1))

    # ---- compute ------------------------------------------------------------------------

    def _check(self, segs: Sequence[Segment]) -> int:
        total = 0
        seen: set[int] = set()
        for s in segs:
            if s.session in seen:
                raise EngineInputError(f"session {s.session} appears twice in one batch")
            seen.add(s.session)
            if self.takes_tokens:
                if s.tokens is None or s.hidden is not None:
                    raise EngineInputError("this stage takes token ids, not hidden states")
                if s.tokens.ndim != 1:
                    raise EngineInputError(f"tokens must be 1-D, got shape {s.tokens.shape}")
                if s.tokens.size and (int(s.tokens.min()) < 0 or int(s.tokens.max()) >= self.n_vocab):
                    raise EngineInputError(f"token id out of range [0, {self.n_vocab})")
            else:
                h = s.hidden
                if h is None or s.tokens is not None:
                    raise EngineInputError("this stage takes hidden states, not token ids")
                if h.ndim != 2 or h.shape[1] != self.n_embd:
                    raise EngineInputError(
                        f"hidden states must have shape (n, {self.n_embd}), got {h.shape}")
                if h.dtype != np.float32:
                    raise EngineInputError(f"hidden states must be float32, got {h.dtype}")
            n = s.n_rows
            if n == 0:
                raise EngineInputError("empty segment")
            if not 0 <= s.n_logits <= n:
                raise EngineInputError(f"n_logits={s.n_logits} outside [0, {n}]")
            expected = self._next_pos.get(s.session, 0)
            if s.pos != expected:
                raise EngineInputError(
                    f"session {s.session}: position {s.pos} given, {expected} expected "
                    "(roll back before re-decoding)")
            if s.pos + n > self.n_ctx:
                raise ContextOverflowError(s.pos + n, self.n_ctx)
            total += n
        if total > self.n_batch:
            raise EngineInputError(f"{total} rows in one call; this engine takes at most {self.n_batch}")
        return total

    def forward(self, segs: Sequence[Segment], *, rewind: bool = False) -> list[np.ndarray]:
        """Run one llama_decode over the rows of several sessions.

        ``rewind``: a segment whose ``pos`` lies before its session's next position first
        rolls the session back to ``pos`` (how pipeline stages drop rejected draft rows
        without a separate trim message: the next window simply starts earlier).

        Returns, per segment: on a non-final stage the float32 hidden states
        ``(n_rows, n_embd)`` after this slice's last layer; on a final stage the float32
        logits ``(n_logits, n_vocab)`` of its last ``n_logits`` rows.
        Raises EngineInputError / ContextOverflowError / EngineBusyError (nothing was
        changed) or DecodeError.
        """
        if rewind:
            for s in segs:
                if s.session in self._next_pos and s.pos < self._next_pos[s.session]:
                    self.rollback(s.session, s.pos)
        if self.pad_rows > 1:
            if len(segs) > 1:
                return self._forward_alone_alike(segs)
            if segs and (width := self._width(segs[0])) > segs[0].n_rows:
                return self._padded(segs, width)
        return self._forward(segs)

    def _pads(self, s: Segment, rows: int) -> bool:
        """Whether ``s`` can run as ``rows`` rows (more than its own, within the batch and
        its context)."""
        return s.n_rows < rows <= self.n_batch and s.pos + rows <= self.n_ctx

    def _width(self, s: Segment) -> int:
        """The rows a GPU engine runs ``s`` as when it runs alone: at least its pad width;
        the widest exact width (4 rows at pad 2) while verify windows wider than the pad
        width keep coming (limits.GPU_STICKY_CALLS: one call shape, one CUDA graph), for a
        segment asking every row's logits or none, where those cells end in the KV bucket
        of the segment's padded one-row step (so every row attends what it would in a
        one-row step: limits.gpu_bucket_drafts)."""
        n, width = s.n_rows, max(s.n_rows, self.pad_rows)
        top = self._wide_rows
        if self._sticky_calls and n <= top:
            # A window asks every row's logits (prefill chunks ask the last or none). Only
            # rows that all reach the head, or none does, go wide: llama.cpp runs the head on
            # the rows asking logits, and its kernels go by their count (1 row is not 3).
            window = s.n_logits == n > self.pad_rows
            wide = window or self._wide_left > 0
            self._wide_left = self._sticky_calls if window else max(0, self._wide_left - 1)
            if (wide and s.n_logits in (0, n) and self._pads(s, top)
                    and kv_bucket(s.pos + top) == kv_bucket(s.pos + self.pad_rows)):
                width = top
        return width if self._pads(s, width) else n

    def _choose_sticky_calls(self, name: str) -> int:
        """How many calls a GPU engine's small calls stay wide after a verify window
        (_width): $MESHNODE_GPU_STICKY_CALLS when set; else, on an engine with layers
        offloaded and a pad width, GPU_STICKY_CALLS where timing this engine shows wide
        calls cost less than calls that change shape (callshape.py), 0 where not."""
        if self.pad_rows == 1:
            return 0
        calls = gpu_sticky_calls()
        if calls is not None or not self.gpu_layers:
            return calls or 0
        wide = self._wide_rows
        if wide <= self.pad_rows or wide > min(self.n_batch, self.n_ctx):
            return 0
        try:
            self.call_shapes = time_call_shapes(self._scratch_step, self.pad_rows, wide)
        except (DecodeError, EngineBusyError) as e:
            log.warning("%s: could not time call shapes (%s); small calls keep their width", name, e)
            return 0
        on = self.call_shapes.wide_wins
        log.info("%s: call shapes on %s: %s; after a verify window small calls %s", name,
                 self.backend, self.call_shapes.summary(),
                 f"stay {wide} rows wide" if on else "keep their width")
        return GPU_STICKY_CALLS if on else 0

    def _scratch_step(self, rows: int) -> None:
        """A one-row step of a scratch session at position 0, run ``rows`` rows wide,
        then forgotten (what time_call_shapes times)."""
        one = ({"tokens": np.zeros(1, dtype=np.int32)} if self.takes_tokens
               else {"hidden": np.zeros((1, self.n_embd), dtype=np.float32)})
        s = Segment(_SCRATCH_SESSION, 0, n_logits=1 if self.has_head else 0, **one)
        try:
            self._padded([s], rows) if rows > 1 else self._forward([s])
        finally:
            self.drop(_SCRATCH_SESSION)

    def _padded(self, segs: Sequence[Segment], rows: int) -> list[np.ndarray]:
        """``segs`` (each of fewer than ``rows`` rows) run as the
        first rows of ``rows`` rows each, whose extra rows are dropped again: the kernels of
        every other padded step. A row does not see the rows after it (causal attention,
        row-wise matmuls), so its result is the one it gets in any padded call. A final
        stage asks logits for the extra rows too: the rows that reach the head are the same
        count in every padded call (llama.cpp prunes the last layer to the rows with outputs)."""
        self._check(segs)
        outs = self._forward([_widened(s, rows) for s in segs])
        for s in segs:
            self.rollback(s.session, s.pos + s.n_rows)
        return [out[:s.n_logits] if self.has_head else out[:s.n_rows] for s, out in zip(segs, outs)]

    def _forward_alone_alike(self, segs: Sequence[Segment]) -> list[np.ndarray]:
        """Several sessions on a GPU engine, each row computed as the session alone would
        compute it (docs/engine.md "GPU", "Sessions together"). On CUDA a call's row count
        picks the matmul kernels, and every session of a call attends as many KV cells as
        the longest one's KV_BUCKET, so 8 sessions in one call gave other logits than each
        alone (SmolLM2 and an 8B Q4_0 shape on an H200, ``packaging/gpu/batch_probe.py``;
        14 of 16 greedy answers changed through a node). Measured exact there: two sessions
        whose cells end in the same bucket, each padded to 2 rows, in one call, with pad 2.
        So with pad 2 short segments (1-2 rows) go in such pairs, and every other segment
        runs as it would alone; all are checked first, so a bad one changes nothing."""
        self._check(segs)
        outs: list[np.ndarray | None] = [None] * len(segs)
        done: list[Segment] = []
        try:
            for group in _alone_alike_groups(segs, self.pad_rows, self.n_ctx, self.n_batch):
                part = [segs[i] for i in group]
                if len(part) == 2:
                    got = self._padded(part, 2)
                elif (width := self._width(part[0])) > part[0].n_rows:
                    got = self._padded(part, width)
                else:
                    got = self._forward(part)
                for i, out in zip(group, got):
                    outs[i] = out
                done += part
        except BaseException:
            for s in done:      # all or nothing, as one call
                self.rollback(s.session, s.pos)
            raise
        return outs  # type: ignore[return-value]

    def _forward(self, segs: Sequence[Segment]) -> list[np.ndarray]:
        self._check(segs)
        for s in segs:
            self._seq(s.session)
        self._pack([s.session for s in segs])
        seqs = [self._seq(s.session) for s in segs]
        outs = [np.empty((s.n_rows if not self.has_head else s.n_logits,
                          self.n_embd if not self.has_head else self.n_vocab), dtype=np.float32)
                for s in segs]
        done = [0] * len(segs)
        try:
            for call in self._calls(segs, seqs):
                if timeline.RECORDER is not None:   # the call with its outputs read (a GPU syncs there)
                    timeline.RECORDER.mark("dec<")
                self._decode(segs, seqs, call, outs)
                if timeline.RECORDER is not None:
                    timeline.RECORDER.mark("dec>")
                for i, first, n in call:
                    done[i] = first + n
                    self._next_pos[segs[i].session] = segs[i].pos + done[i]
        except BaseException:
            for s, seq, d in zip(segs, seqs, done):     # leave no half-run segment behind
                if d:
                    llama_cpp.llama_memory_seq_rm(self._mem, seq, s.pos, -1)
                    self._next_pos[s.session] = s.pos
            raise
        return outs

    def _calls(self, segs: Sequence[Segment], seqs: list[int]) -> list[list[tuple[int, int, int]]]:
        """The llama_decode calls for one forward: each a list of (segment, first row, rows).

        With one KV stream per session llama.cpp splits a batch into micro-batches of
        consecutive sequence ids taking the same number of rows each, ordered by sequence,
        and the capture would come back in that order. So the engine makes each call one
        such micro-batch itself (rows in sequence order, equal counts), and every row's
        place is known. On CPU a call costs about its rows (a 32-row window is ~16 one-row
        steps), so splitting costs little.
        """
        if self.config.kv_unified:
            return [[(i, 0, s.n_rows) for i, s in enumerate(segs)]]
        order = sorted(range(len(segs)), key=lambda i: seqs[i])
        done = [0] * len(segs)
        calls: list[list[tuple[int, int, int]]] = []
        while True:
            active = [i for i in order if done[i] < segs[i].n_rows]
            if not active:
                return calls
            run = [active[0]]
            for i in active[1:]:
                if seqs[i] != seqs[run[-1]] + 1:
                    break
                run.append(i)
            m = min(segs[i].n_rows - done[i] for i in run)
            calls.append([(i, done[i], m) for i in run])
            for i in run:
                done[i] += m

    def _decode(self, segs: Sequence[Segment], seqs: list[int],
                call: list[tuple[int, int, int]], outs: list[np.ndarray]) -> None:
        row = 0
        for i, first, n in call:
            s = segs[i]
            if self.takes_tokens:
                self._tok[row:row + n] = s.tokens[first:first + n]
            else:
                self._embd[row:row + n] = s.hidden[first:first + n]
            self._pos[row:row + n] = np.arange(s.pos + first, s.pos + first + n, dtype=np.int32)
            self._seq_store[row:row + n] = seqs[i]
            if self.has_head:
                # Logits for the rows among the segment's last n_logits.
                lo = max(first, s.n_rows - s.n_logits) - first
                self._out_flags[row:row + n] = 0
                self._out_flags[row + lo:row + n] = 1
            else:
                self._out_flags[row:row + n] = 1
            row += n
        total = row
        self._batch.n_tokens = total
        if self._tap is not None:
            self._tap.reset()
        if self._governor is not None:
            threads = self._governor.threads_for(total)
            if threads != self._threads_now:
                self._set_threads(threads)
        t0 = time.perf_counter()
        rc = llama_cpp.llama_decode(self._ctx, self._batch)
        if rc == 1:
            raise EngineBusyError("no KV cache slot for this batch (too many long sessions)")
        if rc != 0:
            raise DecodeError(f"llama_decode failed with code {rc}")
        if self._governor is not None:
            self._governor.observe(total, time.perf_counter() - t0, self._threads_now)
        self._copies_queued = False     # the decode ran every queued stream copy first
        if not self.has_head:
            assert self._tap is not None and self._tap.stop_layer is not None
            il = self._tap.stop_layer
            got = self._tap.written(il) // (4 * self.n_embd)
            if got != total:
                raise DecodeError(f"captured {got} rows of layer {il}, expected {total}")
            buf = self._tap.buffers[il]
            row = 0
            for i, first, n in call:
                outs[i][first:first + n] = buf[row:row + n]
                row += n
            return
        row = 0
        for i, first, n in call:
            s = segs[i]
            skip = s.n_rows - s.n_logits      # rows of the segment without logits
            for r in range(max(first, skip), first + n):
                ptr = llama_cpp.llama_get_logits_ith(self._ctx, row + r - first)
                ctypes.memmove(outs[i][r - skip].ctypes.data, ptr, 4 * self.n_vocab)
            row += n

    def tapped(self, layer: int, rows: int) -> np.ndarray:
        """Rows captured at ``l_out-{layer}`` by the last forward (certification)."""
        if self._tap is None or layer not in self._tap.buffers:
            raise EngineInputError(f"layer {layer} is not tapped")
        return self._tap.buffers[layer][:rows].copy()

    # ---- convenience for single sessions ------------------------------------------------

    def run_session(self, session: int, pos: int, data: np.ndarray, n_logits: int = 1) -> np.ndarray:
        """Feed ``data`` (tokens or hidden rows) in chunks of n_batch; output of all chunks
        concatenated (hidden) or the last ``n_logits`` logits rows (final stage)."""
        outs = []
        n = data.shape[0]
        for start in range(0, n, self.n_batch):
            chunk = data[start:start + self.n_batch]
            last = start + self.n_batch >= n
            seg = Segment(session, pos + start,
                          tokens=chunk if self.takes_tokens else None,
                          hidden=None if self.takes_tokens else chunk,
                          n_logits=min(n_logits, chunk.shape[0]) if last else 0)
            outs.append(self.forward([seg])[0])
        if self.has_head:
            return outs[-1]
        return np.concatenate(outs, axis=0)

    # ---- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        if self._ctx is not None:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> "StageEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # last resort; close() is the contract
        try:
            self.close()
        except Exception:
            pass


def _widened(s: Segment, rows: int) -> Segment:
    """``s`` grown to ``rows`` rows: its last token repeated, or zero hidden states (the
    rows are rolled back after the call); logits asked for the extra rows too when any."""
    extra = rows - s.n_rows
    n_logits = s.n_logits + extra if s.n_logits else 0
    if s.tokens is not None:
        return Segment(s.session, s.pos, tokens=np.concatenate([s.tokens, np.repeat(s.tokens[-1:], extra)]),
                       n_logits=n_logits)
    assert s.hidden is not None
    return Segment(s.session, s.pos, n_logits=n_logits, hidden=np.concatenate(
        [s.hidden, np.zeros((extra, s.hidden.shape[1]), dtype=s.hidden.dtype)]))


def _alone_alike_groups(segs: Sequence[Segment], pad_rows: int, n_ctx: int, n_batch: int) -> list[list[int]]:
    """The calls a GPU engine runs several segments as (indices into ``segs``): with
    ``pad_rows`` 2, segments of 1-2 rows whose cells (padded to 2) end in the same
    KV_BUCKET in pairs, in order of arrival; every other segment alone. Not paired: a
    2-row segment asking one logit row, whose head runs 1 row alone (the head's kernels
    go by its rows too; a pair's head runs 0, 2 or 4)."""
    groups: list[list[int]] = []
    waiting: dict[int, int] = {}       # bucket -> the group holding one short segment
    for i, s in enumerate(segs):
        if (pad_rows == 2 and (s.n_rows == 1 or (s.n_rows == 2 and s.n_logits != 1))
                and s.pos + 2 <= n_ctx and n_batch >= 4):
            bucket = kv_bucket(s.pos + 2)
            g = waiting.pop(bucket, None)
            if g is None:
                waiting[bucket] = len(groups)
                groups.append([i])
            else:
                groups[g].append(i)
        else:
            groups.append([i])
    return groups
