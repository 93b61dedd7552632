"""A draft model for speculative decoding (issue 45): a smaller model sharing the target's
tokenizer, run by the same worker beside the target with a paged KV cache of its own.

`DraftProposer` is a proposer (tandem.speculative.proposers.Proposer) that runs a model. For
each request it keeps the token ids whose KV its cache holds (`written`); a proposal first
catches the draft up on the request's tokens past the longest prefix it already holds (after
a verify: the accepted draft tokens stay, the rest and the target's own token are computed),
then decodes k tokens greedily, one draft forward each:

    tokens   p0 .. p9 a1 a2 t      (prompt, output; t: the target's newest token)
    written  p0 .. p9 a1 a2 x3     (x3: a rejected draft token's KV)
    catch-up positions 12..13 (x3's slot rewritten with t's), sample d1; then d2 .. dk

A greedy draft is a deterministic function of the request's tokens, so verification's rule
(accept while the target's own sample equals the draft, tandem.engine.verify) keeps greedy
and seeded output exact. The draft's blocks come from its own pool: a request that needs
blocks when none are free takes them from the request that drafted longest ago (which
catches up again when it next drafts); with none to take, it does not draft this step.

In a hand-off the prefill worker prefills the draft too and packs its KV for the prompt into
the hand-off's `draft_kv` section (`DraftProposer.pack`, tandem.transfer.sections); the decode
worker unpacks it (`unpack`) and drafts from its first step with no draft prefill
(`SpecStats.draft_prefill_tokens` counts the prompt tokens the draft computed here).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch

from tandem.config import EngineConfig
from tandem.engine.kv_cache import allocate_kv_cache, block_bytes
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.runner import ModelRunner, StepRow
from tandem.engine.sampling import Sampler
from tandem.engine.state_pages import AppendedSection, read_payload, write_payload
from tandem.model.config import ModelConfig
from tandem.model.llama import LlamaModel
from tandem.model.triton_attention import make_attention
from tandem.transfer.sections import HandoffSection, SectionKind
from tandem.weights.loader import DTYPES, load_model

FORMAT_VERSION = "draft.v1"
# Requests whose whole context the draft's pool holds at once, past max_batch (those that
# draft in one step): the rest catch up again when they next draft.
SPARE_REQUESTS = 2
_HASHED_WEIGHT_BYTES = 1 << 20  # of each weight file, with its size, in the fingerprint


def fingerprint(model_dir: Path) -> str:
    """What identifies a draft checkpoint between workers: its config and, per weight file,
    its size and first MiB (so a fine-tune of the same shape differs)."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{path.name}:{path.stat().st_size}".encode())
        with path.open("rb") as f:
            h.update(f.read(_HASHED_WEIGHT_BYTES))
    return h.hexdigest()[:16]


def _vocabulary(model_dir: Path) -> object:
    """The tokenizer's vocabulary and added tokens (what token ids mean)."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ValueError(
            f"draft model {model_dir}: no tokenizer.json (a draft must share the target "
            "model's tokenizer; copy the target's)"
        )
    data = json.loads(path.read_text())
    return data.get("model", {}).get("vocab"), data.get("added_tokens")


def check_draft(
    target: ModelConfig, target_dir: Path, draft: ModelConfig, draft_dir: Path, tp: int
) -> None:
    """Raise ValueError unless `draft` can draft for `target` on this worker: the same
    vocabulary and tokenizer, a plain attention model, a target whose hand-off can carry
    the draft's KV (one KV table, no linear-attention state), one rank."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft model {draft_dir}: vocabulary of {draft.vocab_size} tokens, the target's "
            f"is {target.vocab_size}: a draft must share the target's tokenizer"
        )
    if (target_dir / "tokenizer.json").is_file() and _vocabulary(draft_dir) != _vocabulary(
        target_dir
    ):
        raise ValueError(
            f"draft model {draft_dir}: its tokenizer differs from the target's ({target_dir}): "
            "the same token ids would mean different text"
        )
    for name, cfg in (("draft", draft), ("target", target)):
        if cfg.features.linear is not None or cfg.kv_layout.num_tables > 1:
            raise ValueError(
                f"speculative draft: the {name} model has linear-attention or sliding-window "
                "layers; a draft model serves targets with one KV table for now (use "
                "--speculative ngram or suffix)"
            )
    if draft.features.mla is not None:
        raise ValueError(f"draft model {draft_dir}: latent attention (MLA) drafts are not built")
    if tp > 1:
        raise ValueError(
            "speculative draft runs on single-rank workers for now; serve with "
            "--tensor-parallel-size 1 or --speculative ngram|suffix"
        )


def load_draft(config: EngineConfig) -> DraftProposer:
    """The draft model of `config.speculative` with a pool for the contexts of the requests
    that draft in one step (max_batch) and `SPARE_REQUESTS` more, and never more tokens than
    the target's cache holds where that is known now (`_target_blocks`). The engine loads
    it (and allocates its cache) before sizing the target's cache, which so leaves room for
    both on a GPU.

    Raises:
        ValueError: see `check_draft`; FileNotFoundError: no such directory.
    """
    draft_dir, target_dir = Path(config.speculative.draft_model), Path(config.model_dir)
    target = ModelConfig.from_dir(target_dir)
    draft_cfg = ModelConfig.from_dir(draft_dir)
    check_draft(target, target_dir, draft_cfg, draft_dir, config.tensor_parallel_size)
    model = load_model(
        draft_dir,
        config.resolved_dtype,
        config.device,
        attention=make_attention(config.attention_backend, config.device),
        cpu_matmul=config.cpu_matmul,
    )
    limit = config.scheduler.max_model_len or target.max_position_embeddings
    max_len = min(limit, target.max_position_embeddings, draft_cfg.max_position_embeddings)
    bs = config.cache.block_size
    per_request = -(-(max_len + config.speculative.num_speculative_tokens) // bs)
    dtype = DTYPES[config.resolved_dtype]
    num_blocks = per_request * (config.speculative.max_batch + SPARE_REQUESTS)
    target_blocks = _target_blocks(config, target, dtype)
    if target_blocks is not None and target_blocks < num_blocks:
        num_blocks = max(target_blocks, 1)
        max_len = min(max_len, num_blocks * bs - config.speculative.num_speculative_tokens)
    cache = allocate_kv_cache(model.config, num_blocks, bs, dtype, torch.device(config.device))
    fmt = (
        f"{FORMAT_VERSION} {fingerprint(draft_dir)} {str(dtype).removeprefix('torch.')} "
        f"{model.config.kv_layout.slots}x{model.config.num_kv_heads}x{model.config.head_dim}"
    )
    chunk = config.scheduler.max_num_batched_tokens
    return DraftProposer(model, cache, bs, max_len, chunk, fmt)


def _target_blocks(config: EngineConfig, target: ModelConfig, dtype: torch.dtype) -> int | None:
    """The blocks the target's cache will hold where that is known before it loads (a
    count, a CPU byte budget); None on a GPU (sized after the weights and a profile)."""
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
    if torch.device(config.device).type == "cuda":
        return None
    return cache.kv_cache_bytes // block_bytes(target, cache.block_size, dtype)


class DraftProposer:
    """A draft model's proposals (see the module doc). Not thread-safe: the engine's."""

    name = "draft"

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: torch.Tensor,
        block_size: int,
        max_len: int,
        chunk: int,
        fmt: str,
    ) -> None:
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.max_len, self.chunk, self.format = max_len, max(chunk, 1), fmt
        self.block_bytes = block_bytes(model.config, block_size, kv_cache.dtype)
        unused = Sampler(torch.Generator(device=kv_cache.device))  # the draft is greedy
        self.runner = ModelRunner(model, kv_cache, block_size, unused, max_len)
        self._free = list(range(kv_cache.shape[0] - 1, -1, -1))
        self._tables: OrderedDict[str, list[int]] = OrderedDict()  # least recently drafted first
        self._tokens: dict[str, list[int]] = {}  # request id -> its tokens
        self._written: dict[str, list[int]] = {}  # request id -> tokens the cache holds KV of
        self._prompt: dict[str, int] = {}  # request id -> its prompt's length
        self.prefill_tokens = 0  # prompt tokens computed by catch-ups
        self.handoff_tokens = 0  # prompt tokens whose KV arrived in a hand-off

    # -- the Proposer interface --------------------------------------------------------------

    def start(
        self, request_id: str, token_ids: Sequence[int], tenant: str = "", num_prompt: int = 0
    ) -> None:
        self._tokens[request_id] = list(token_ids)
        self._written.setdefault(request_id, [])  # a hand-off's unpacked KV stays
        self._prompt[request_id] = num_prompt

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._tokens[request_id] += token_ids

    def propose(self, request_id: str, k: int) -> list[int]:
        tokens = self._tokens[request_id]
        n = len(tokens)
        if n + k - 1 > self.max_len:
            return []
        table = self._blocks(request_id, n + k - 1)
        if table is None:
            return []
        valid = min(_common_prefix(self._written[request_id], tokens), n - 1)
        draft = [self._catch_up(request_id, tokens, valid, table)]
        for i in range(1, k):
            draft.append(self._forward(request_id, n - 1 + i, [draft[-1]], table, True))
        self._written[request_id] = tokens + draft[:-1]
        return draft

    def finish(self, request_id: str) -> None:
        for held in (self._tokens, self._written, self._prompt):
            held.pop(request_id, None)
        self._free += reversed(self._tables.pop(request_id, []))
        self.runner.release(request_id)

    def num_requests(self) -> int:
        return len(self._tokens)

    # -- the hand-off's draft_kv section -------------------------------------------------------

    def payload_bytes(self, num_tokens: int) -> int:
        """Bytes of the draft KV of `num_tokens` prompt tokens in a hand-off: whole blocks."""
        return -(-num_tokens // self.block_size) * self.block_bytes

    def pack(
        self, request_id: str, prompt: Sequence[int], kv: torch.Tensor, into: list[int]
    ) -> bool:
        """Prefill role: the draft's KV of `prompt`, computed now, into the target's cache
        blocks `into` (enough for `payload_bytes`); the draft's own blocks go back. False:
        no room in the draft's pool (the hand-off then carries no draft section)."""
        table = self._blocks(request_id, len(prompt))
        if table is None:
            return False
        self._tokens[request_id], self._prompt[request_id] = list(prompt), len(prompt)
        self._written[request_id] = []
        self._catch_up(request_id, list(prompt), 0, table, sample=False)
        used = table[: -(-len(prompt) // self.block_size)]
        write_payload(kv, into, self.kv_cache[used].reshape(-1).view(torch.uint8))
        self.finish(request_id)
        return True

    def unpack(
        self, request_id: str, prompt: Sequence[int], kv: torch.Tensor, read: list[int]
    ) -> None:
        """Decode role: the draft KV of `prompt` read into the target's blocks `read`, into
        the draft's cache; with no room there the request catches up when it drafts."""
        table = self._blocks(request_id, len(prompt))
        if table is None:
            return
        used = table[: -(-len(prompt) // self.block_size)]
        payload = read_payload(kv, read, self.payload_bytes(len(prompt)))
        self.kv_cache[used] = payload.view(self.kv_cache.dtype).view(
            len(used), *self.kv_cache.shape[1:]
        )
        self._written[request_id] = list(prompt)
        self.handoff_tokens += len(prompt)

    # -- internals ---------------------------------------------------------------------------

    def _blocks(self, request_id: str, num_tokens: int) -> list[int] | None:
        """The request's draft blocks, grown to hold `num_tokens` positions (taking the least
        recently drafting requests' blocks when the pool is out); None: not enough even so."""
        table = self._tables.pop(request_id, [])
        need = -(-num_tokens // self.block_size) - len(table)
        while need > len(self._free) and self._tables:
            other, blocks = self._tables.popitem(last=False)
            self._free += reversed(blocks)
            self._written[other] = []
        if need > len(self._free):
            self._free += reversed(table)
            self._written[request_id] = []
            return None
        for _ in range(max(need, 0)):
            table.append(self._free.pop())
        self._tables[request_id] = table  # now the most recent
        return table

    def _catch_up(
        self, request_id: str, tokens: list[int], start: int, table: list[int], sample: bool = True
    ) -> int:
        """Compute tokens[start:] into the draft's cache, in chunks; the greedy next token."""
        prompt = self._prompt.get(request_id, 0)
        self.prefill_tokens += max(0, min(prompt, len(tokens)) - start)
        token = -1
        for at in range(start, len(tokens), self.chunk):
            ids = tokens[at : at + self.chunk]
            last = at + len(ids) == len(tokens)
            token = self._forward(request_id, at, ids, table, sample and last)
        return token

    def _forward(
        self, request_id: str, start: int, ids: list[int], table: list[int], sample: bool
    ) -> int:
        """One draft forward of `ids` at positions from `start`; the argmax after the last
        (-1 when not `sample`)."""
        row = StepRow(request_id, start, len(ids), tuple(table), sample, ids)
        step = self.runner.prepare_rows([row])
        hidden = self.model.forward(step.input_ids, step.positions, step.meta, self.kv_cache)
        if not sample:
            return -1
        logits = self.model.compute_logits(hidden[step.last_idx])
        return int(logits[0].argmax())


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # the first difference, by bisection over slices
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class DraftHandoff(AppendedSection):
    """An engine's side of a hand-off's draft_kv section (as state_pages.StateHandoff is of
    its linear_state section).

    Prefill role: `pack` prefills the draft over a handed-off prompt and puts its KV in
    blocks appended to the request's table (pinned with its pages, freed with them). Decode
    role: `reserve` appends as many blocks for the read, `unpack` moves what was read into
    the draft's cache and frees them.
    """

    def __init__(self, kv: KVCacheManager, kv_cache: torch.Tensor, proposer: DraftProposer) -> None:
        super().__init__(kv)
        self.kv_cache, self.proposer = kv_cache, proposer
        self.format = proposer.format
        self._block_bytes = kv_cache[0].nbytes

    def num_bytes(self, num_tokens: int) -> int:
        return self.proposer.payload_bytes(num_tokens)

    def section(self, num_tokens: int, num_blocks: int) -> HandoffSection | None:
        """The section of a packed prompt of `num_tokens` (None: `pack` packed nothing)."""
        if not num_blocks:
            return None
        return HandoffSection(
            SectionKind.DRAFT_KV, self.format, num_blocks, self.num_bytes(num_tokens)
        )

    def _num_blocks(self, num_tokens: int) -> int:
        return -(-self.num_bytes(num_tokens) // self._block_bytes)

    def pack(self, request_id: str, prompt: Sequence[int]) -> int:
        """Blocks now holding the draft's KV of `prompt`, after the request's other blocks;
        0 when too few are free (the hand-off then has no draft section, which its reader
        refuses: it prefills again)."""
        n = self._num_blocks(len(prompt))
        ids = self.kv.append_blocks(request_id, n)
        if ids is None:
            return 0
        if not self.proposer.pack(request_id, prompt, self.kv_cache, ids):
            self.kv.drop_blocks(request_id, n)
            return 0
        return n

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Blocks to read a hand-off's draft KV into; None when too few are free."""
        return self._reserve(request_id, self._num_blocks(num_tokens))

    def unpack(self, request_id: str, prompt: Sequence[int]) -> None:
        """The draft KV read into the reserved blocks into the draft's cache; the blocks
        go back. Nothing to do for a request without."""
        self._unpack(
            request_id, lambda ids: self.proposer.unpack(request_id, prompt, self.kv_cache, ids)
        )
