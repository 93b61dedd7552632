"""Load a HuggingFace model directory (config.json + safetensors) into `LlamaModel`.

Weights stream into place. Every tensor the model needs is checked (present, right shape)
before anything is read; then each is read from its file into one reused host buffer and
copied straight into its slot of the fused, transposed layout, in the target dtype and on the
target device. Peak memory is the weights plus the largest single tensor (plus, for fused
or cast weights, one transposed part), not the 2x of reading every tensor and then building
fused copies of them. On a GPU a matrix is copied to the device as it is in the file and
transposed there: host transposes of every matrix would cost minutes for a 70B model.

The files are read by `tandem.weights.safetensors_io` (one tensor at a time, no mmap).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from tandem.model.attention import AttentionBackend, TorchAttention
from tandem.model.config import ModelConfig
from tandem.model.linear import choose_matmul, onednn_bf16_available
from tandem.model.llama import LayerWeights, LlamaModel, ModelWeights, Weight
from tandem.model.moe import MoeWeights, expert_names, router_name
from tandem.model.triton_attention import TritonAttention
from tandem.parallel.group import TPGroup
from tandem.parallel.sharding import (
    Shard,
    TensorSlice,
    check_shardable,
    expert_intermediate,
    foreign_experts,
    local_config,
    local_experts,
    sliced_shapes,
    tensor_slices,
    vocab_per_rank,
)
from tandem.quant.checkpoint import (
    QuantizedReader,
    read_checkpoint_quant,
    stored_shapes,
    stored_slices,
)
from tandem.quant.gguf import GGUF_FILE, GGUFMatrices, gguf_matrices
from tandem.quant.linear import QuantLinear
from tandem.quant.online import quantized_matrix
from tandem.quant.weight import WeightScheme
from tandem.weights import families
from tandem.weights.safetensors_io import (
    ProgressFn,
    TensorEntry,
    TensorReader,
    read_header,
    safetensors_files,
)
from tandem.weights.shapes import check_entries, expected_shapes

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

MIB = 1 << 20


class WeightBuilder:
    """Allocates each weight in the target dtype/device and fills it from the reader."""

    def __init__(
        self,
        reader: TensorReader | QuantizedReader | GGUFMatrices,
        shapes: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        device: torch.device,
        quantization: WeightScheme = WeightScheme.NONE,
        group_size: int = 64,
        row_parallel: frozenset[str] = frozenset(),
        reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None,
        mxfp4: bool = False,
        fused_experts: bool = False,
    ) -> None:
        """`row_parallel`: the tensors this tensor-parallel rank holds some columns of;
        `reduce_max`: the elementwise maximum over the ranks (a collective), which gives
        their quantized rows the whole row's scales (`quantized_matrix`); `mxfp4`: a
        gpt-oss checkpoint's MXFP4 experts; `fused_experts`: a DeepSeek-V3 checkpoint's
        stacked experts (tandem.weights.families)."""
        self.reader = reader
        self.mxfp4 = mxfp4
        self.fused_experts = fused_experts
        self.expert_columns: range | None = None  # a TP rank's of each expert (DeepSeek-V3)
        self.row_parallel = row_parallel
        self.reduce_max = reduce_max
        self.shapes = shapes
        self.dtype = dtype
        self.device = device
        self.quantization = quantization  # the layer matrices' scheme (tandem.quant.online)
        self.group_size = group_size
        self.transpose_on_device = device.type != "cpu"
        self._staging: torch.Tensor | None = None  # copy_transposed's reused buffer

    def fused(self, names: Sequence[str], transpose: bool = False) -> torch.Tensor:
        """cat([tensor(n) for n in names]) along dim 0, transposed if asked, built in place.

        One destination is allocated and each source is copied into its rows (its columns
        when transposed); the concatenation is never materialized:

            transpose=True:   dst [hid, rows_a + rows_b]
                              +--------------+--------------+
                              |  a.t()       |  b.t()       |   a: [rows_a, hid]
                              +--------------+--------------+   b: [rows_b, hid]
                              0            rows_a     rows_a + rows_b
        """
        shapes = [self.shapes[n] for n in names]
        rows = [s[0] for s in shapes]
        cat_shape = (sum(rows), *shapes[0][1:])
        dst = torch.empty(
            cat_shape[::-1] if transpose else cat_shape, dtype=self.dtype, device=self.device
        )
        start = 0
        for name, n in zip(names, rows, strict=True):
            src = self.reader.read(name)  # copy_ converts its dtype and moves it to the device
            if transpose:
                self.copy_transposed(dst[:, start : start + n], src)
            else:
                dst[start : start + n].copy_(src)
            del src  # a view of the reader's buffer: the next read overwrites it
            start += n
        return dst

    def copy_transposed(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst[:] = src.t(), with src read from the host.

        On a GPU (`transpose_on_device`) src is copied to the device (and cast) in its own
        layout, then transposed there at memory speed. On a CPU, through torch's
        blocked-transpose kernel, 3-4x faster than the strided copy it falls back to
        otherwise; that kernel needs a contiguous destination of src's dtype, so anything
        else (a column slice of a fused weight, a dtype cast) goes through a contiguous
        transposed copy in a host buffer. Either staging buffer is allocated once and reused,
        so memory is not fragmented by one short-lived temporary per tensor.
        """
        # dst: [in, out]; src: [out, in]
        if self.transpose_on_device:
            staged = self._stage(src.numel(), dst.dtype, dst.device).view(src.shape)
            staged.copy_(src)
            dst.copy_(staged.t())
            return
        if dst.is_contiguous() and dst.dtype == src.dtype:
            dst.copy_(src.t())
            return
        tmp = self._stage(src.numel(), src.dtype, src.device).view(src.shape[1], src.shape[0])
        tmp.copy_(src.t())
        dst.copy_(tmp)

    def _stage(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The first n elements of the staging buffer, grown or replaced as needed."""
        buf = self._staging
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            self._staging = None  # free the old buffer before allocating its replacement
            buf = self._staging = torch.empty(n, dtype=dtype, device=device)
        return buf[:n]

    def matrix(self, names: Sequence[str]) -> Weight:
        """A layer matrix: dense and transposed ([in, out], `fused`), or quantized as loaded
        ([out, in], tandem.quant.online) when the builder quantizes."""
        if self.quantization is WeightScheme.NONE:
            return self.fused(names, transpose=True)
        split = self.reduce_max is not None and any(n in self.row_parallel for n in names)
        return quantized_matrix(
            self.reader, names, self.quantization, self.group_size, self.device, self.dtype,
            row_absmax=self.reduce_max if split else None,
        )  # fmt: skip

    def vocab(self, name: str, rows: int | None) -> torch.Tensor:
        """The embedding ([vocab, hid]) or lm_head ([hid, vocab], transposed like every
        matrix), zero-padded to `rows` vocabulary rows when given (a vocabulary-parallel
        rank's share: the padding's logits are dropped after the all-gather)."""
        lm_head = name == "lm_head.weight"
        if rows is None:
            return self.fused([name], transpose=lm_head)
        n, hid = self.shapes[name]
        shape = (hid, rows) if lm_head else (rows, hid)
        dst = torch.zeros(shape, dtype=self.dtype, device=self.device)
        src = self.reader.read(name)  # [n, hid]
        if lm_head:
            self.copy_transposed(dst[:, :n], src)
        else:
            dst[:n].copy_(src)
        del src
        return dst

    def experts(self, config: ModelConfig, i: int, experts: range | None = None) -> MoeWeights:
        """Layer i's router (whole on every rank) and experts, each expert's gate and up fused
        and transposed into its slot of one stacked tensor (the per-expert tensors of the
        file never coexist)."""
        assert config.moe is not None
        if self.quantization is not WeightScheme.NONE:
            raise ValueError("mixture-of-experts models serve unquantized weights only for now")
        mine = experts if experts is not None else range(config.moe.num_experts)
        reader = self.reader
        if config.architecture == families.DEEPSEEK_V3:
            assert isinstance(reader, TensorReader)
            return families.deepseek_experts(
                reader, config, i, self.fused_experts, self.dtype, self.device, mine,
                self.expert_columns,
            )  # fmt: skip
        if config.architecture == families.GPT_OSS:
            assert isinstance(reader, TensorReader)
            # MXFP4 experts stay in 4 bits where the fused MoE kernel decodes them (CUDA)
            return families.gpt_oss_experts(
                reader, config, i, mine, self.mxfp4, self.dtype, self.device,
                keep_4bit=self.device.type == "cuda",
            )  # fmt: skip
        num, hid = len(mine), config.hidden_size
        # a tensor-parallel rank's share of each expert's columns (the shapes are sliced)
        inter = self.shapes[expert_names(config.architecture, i, mine.start)[0]][0]
        router = self.fused([router_name(config.architecture, i)], transpose=True)  # [hid, E]
        gate_up = torch.empty(num, hid, 2 * inter, dtype=self.dtype, device=self.device)
        down = torch.empty(num, inter, hid, dtype=self.dtype, device=self.device)
        for e in range(num):
            gate, up, down_name = expert_names(config.architecture, i, mine.start + e)
            for name, dst in ((gate, gate_up[e, :, :inter]), (up, gate_up[e, :, inter:])):
                self.copy_transposed(dst, self.reader.read(name))
            self.copy_transposed(down[e], self.reader.read(down_name))
        shared = None
        if config.features.shared_expert_size:  # Qwen3-Next: gate | up, down, its gate
            name = f"model.layers.{i}.mlp.shared_expert"
            shared = (
                self.fused([f"{name}.gate_proj.weight", f"{name}.up_proj.weight"], True),
                self.fused([f"{name}.down_proj.weight"], transpose=True),
                self.fused([f"{name}_gate.weight"], transpose=True),
            )
        return MoeWeights(
            router=router,
            gate_up=gate_up,
            down=down,
            first_expert=mine.start,
            shared=shared,
        )

    def norm(self, config: ModelConfig, name: str) -> torch.Tensor:
        """An RMSNorm's weight (Gemma's and Qwen3-Next's as 1 + w in float32)."""
        offset = config.features.offset_norms
        return families.norm(self.reader, name, offset, self.dtype, self.device)

    def layer(self, config: ModelConfig, i: int, experts: range | None = None) -> LayerWeights:
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        sparse = config.moe is not None and i in config.moe.sparse_layers
        feat = config.features
        sandwich = feat.sandwich_norms
        # Gemma's sandwich: post_attention_layernorm norms the attention's output, the MLP
        # has its own pre- and post-norms; Llama's post_attention_layernorm is the pre-MLP one
        post = p + ("pre_feedforward" if sandwich else "post_attention") + "_layernorm.weight"
        linear = i in feat.linear_layers
        # a Gated DeltaNet layer (Qwen3-Next) has no q/k/v/o, nor an MLA one (DeepSeek-V3)
        attention = not linear and feat.mla is None
        reader = self.reader
        if (linear or feat.mla) and not isinstance(reader, TensorReader):
            raise ValueError(
                "linear-attention layers (Qwen3-Next) load from dense safetensors checkpoints "
                "only for now (not a quantized checkpoint or a kept GGUF)"
            )
        return LayerWeights(
            # qkv: [hid, q_out + 2 * kv_out]
            qkv=self.matrix([attn + f"{x}_proj.weight" for x in "qkv"]) if attention else None,
            qkv_bias=(
                self.fused([attn + f"{x}_proj.bias" for x in "qkv"]) if config.qkv_bias else None
            ),
            input_norm=self.norm(config, p + "input_layernorm.weight"),
            q_norm=self.norm(config, attn + "q_norm.weight")
            if config.qk_norm and attention
            else None,
            k_norm=self.norm(config, attn + "k_norm.weight")
            if config.qk_norm and attention
            else None,
            o=self.matrix([attn + "o_proj.weight"]) if attention else None,  # [q_out, hid]
            linear=families.linear_layer(reader, config, i, self.dtype, self.device)
            if linear
            else None,
            mla=families.mla_layer(reader, config, i, self.dtype, self.device)
            if feat.mla
            else None,
            o_bias=self.fused([attn + "o_proj.bias"]) if feat.o_bias else None,
            sinks=self.fused([attn + "sinks"]).float() if feat.sinks else None,
            post_norm=self.norm(config, post),
            attn_out_norm=self.norm(config, p + "post_attention_layernorm.weight")
            if sandwich
            else None,
            mlp_out_norm=self.norm(config, p + "post_feedforward_layernorm.weight")
            if sandwich
            else None,
            # gate_up: [hid, 2 * inter]
            gate_up=None
            if sparse
            else self.matrix([p + f"mlp.{x}_proj.weight" for x in ("gate", "up")]),
            down=None if sparse else self.matrix([p + "mlp.down_proj.weight"]),  # [inter, hid]
            moe=self.experts(config, i, experts) if sparse else None,
        )

    def model(
        self, config: ModelConfig, vocab_rows: int | None = None, experts: range | None = None
    ) -> ModelWeights:
        """`vocab_rows`: a vocabulary-parallel rank's rows per rank; its embedding and
        lm_head are padded with zero rows to that many (tandem.parallel.sharding). `experts`:
        the experts an expert-parallel rank holds (default all)."""
        layers = [self.layer(config, i, experts) for i in range(config.num_layers)]
        embed = self.vocab("model.embed_tokens.weight", vocab_rows)
        if config.tie_word_embeddings:
            lm_head = embed.t()  # shares storage with the embedding
        else:
            lm_head = self.vocab("lm_head.weight", vocab_rows)  # [hid, vocab]
        return ModelWeights(
            embed=embed,
            layers=layers,
            final_norm=self.norm(config, "model.norm.weight"),
            lm_head=lm_head,
        )


def load_weights(
    model_dir: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    progress: ProgressFn | None = None,
    quantization: WeightScheme = WeightScheme.NONE,
    group_size: int = 64,
    shard: Shard | None = None,
    reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> ModelWeights:
    """Check, then stream the weights of `model_dir` into our layout (see the module doc).
    `quantization`: the layer matrices' scheme (quantized as they load, or kept as a
    quantized checkpoint or kept GGUF stores them: tandem.quant.online); `group_size`:
    int4's. `shard`: a tensor-parallel rank's part only (tandem.parallel.sharding), read as
    slices of the stored tensors: no rank ever holds the whole model. A quantized
    checkpoint's layers and a kept GGUF's blocks are sliced the same way, in their own
    packing (`checkpoint.stored_slices`, `quant.gguf.quantized_slice`): each rank
    holds exactly its rows or columns of what one rank would hold. `reduce_max`: the
    group's elementwise-maximum collective, with which a rank quantizing (or taking a Q8_0
    GGUF's) columns of a row-parallel matrix takes the whole rows' int8 / fp8 scales.

    Raises:
        FileNotFoundError: a weight file is missing.
        ValueError: a corrupt file, a missing or misshapen tensor; a tensor-parallel
            rank's input columns that split a quantization group of a layer kept quantized
            (Megatron's split of o or down: `checkpoint.convert_slice`).
    """
    t0 = time.perf_counter()
    files = safetensors_files(model_dir)
    entries: dict[str, TensorEntry] = {}
    for f in files:
        entries.update(read_header(f))
    mxfp4 = config.architecture == families.GPT_OSS and families.is_mxfp4(model_dir)
    fused = families.fused_experts(config, entries)
    shapes = expected_shapes(config, mxfp4, fused)
    if shard is not None and shard.size > 1 and shard.expert_parallel:
        foreign = foreign_experts(config, shard)  # other ranks' experts: never read here
        shapes = {n: s for n, s in shapes.items() if n not in foreign}
    # A quantized checkpoint (config.json's quantization_config) stores its linear layers
    # in its own tensors: read those, converted by tandem.quant.checkpoint.
    quant = None if mxfp4 else read_checkpoint_quant(model_dir)
    if config.features.mla is not None:
        families.check_mla(config, quant is not None, quantization, entries)
    stored, quantized = stored_shapes(quant, shapes, entries) if quant else (shapes, {})
    # A converted GGUF kept beside its safetensors serves its matrices in their own scheme.
    kept = None if quant else gguf_matrices(model_dir, None, quantization, config)
    if kept is not None:
        stored = {n: s for n, s in stored.items() if n not in kept.layers}
    check_entries(entries, stored)
    slices: dict[str, TensorSlice] = {}
    vocab_rows = None
    if shard is not None and shard.size > 1:
        check_shardable(config, shard.size)
        slices = tensor_slices(config, shard)
        if fused:  # stacked experts: cut as loaded (families.deepseek_experts), not read so
            slices = {n: s for n, s in slices.items() if n in shapes}
        vocab_rows = vocab_per_rank(config, shard.size)
    # A tensor-parallel rank reads its part of a quantized layer as parts of the stored
    # tensors (checkpoint.stored_slices), or of a kept GGUF's blocks.
    read_slices = dict(slices)
    if quant:
        read_slices.update(stored_slices(quant, quantized, slices))
    if kept is not None:
        kept.slices = {n: s for n, s in slices.items() if n in kept.layers}
        kept.row_absmax = reduce_max
    file_bytes = sum(entries[n].num_bytes for n in stored)
    logger.info(
        "loading %s: %d tensors, %.1f MiB in %d file(s), as %s on %s%s",
        model_dir,
        len(stored),
        file_bytes / MIB,
        len(files),
        str(dtype).removeprefix("torch."),
        device,
        f" ({quant.format} checkpoint, {len(quantized)} layers dequantized)" if quant else "",
    )
    with TensorReader(entries, list(stored), progress, read_slices) as reader:
        source: TensorReader | QuantizedReader | GGUFMatrices
        source = QuantizedReader(reader, quant, quantized, slices) if quant else reader
        if kept is not None:
            kept.dense, source = reader, kept
        row_parallel = frozenset(n for n, s in slices.items() if s.dim == 1)
        builder = WeightBuilder(
            source, sliced_shapes(shapes, slices), dtype, device, quantization, group_size,
            row_parallel, reduce_max, mxfp4, fused,
        )  # fmt: skip
        experts = local_experts(config, shard) if config.moe and shard else None
        if config.moe and shard and shard.size > 1:  # each expert's columns (DeepSeek-V3)
            builder.expert_columns = expert_intermediate(config, shard)
        weights = builder.model(config, vocab_rows, experts)
    assert reader.num_read == len(stored), f"read {reader.num_read} of {len(stored)} tensors"
    logger.info(
        "loaded %s: %d tensors, %.1f MiB of weights as %s%s on %s in %.2f s",
        model_dir,
        reader.num_read,
        weights.num_bytes() / MIB,
        str(dtype).removeprefix("torch."),
        ""
        if quantization is WeightScheme.NONE
        else f" with {quantization.value} layer matrices"
        + (f" ({len(kept.layers)} kept from {GGUF_FILE})" if kept is not None else ""),
        device,
        time.perf_counter() - t0,
    )
    return weights


def load_model(
    model_dir: str | Path,
    dtype: str = "float32",
    device: str = "cpu",
    max_positions: int | None = None,
    attention: AttentionBackend | None = None,
    progress: ProgressFn | None = None,
    quantization: str = "none",
    quantization_group_size: int = 64,
    tp: TPGroup | None = None,
    cpu_matmul: str = "auto",
) -> LlamaModel:
    """Load config and weights from a HuggingFace directory; `quantization` (none, int8,
    int4, fp8) quantizes the layer matrices (tandem.quant.online). `tp`: this process
    is one rank of a tensor-parallel group: it loads and runs its shard only. `cpu_matmul`:
    tandem.model.linear.choose_matmul.

    Raises:
        FileNotFoundError: config.json or a weight file is missing.
        ValueError: unsupported architecture, corrupt file, missing or misshapen tensor.
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    config = ModelConfig.from_dir(path)
    if config.features.mla is not None and isinstance(attention, TritonAttention):
        attention.mla = config.features.mla  # its warm-up compiles the MLA decode kernel
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    dev = torch.device(device)
    scheme = WeightScheme(quantization)
    shard = tp.shard if tp is not None else None
    weights = load_weights(
        path, config, DTYPES[dtype], dev, progress, scheme, quantization_group_size, shard,
        tp.all_reduce_max if tp is not None else None,
    )  # fmt: skip
    mm = choose_matmul(dev, DTYPES[dtype], onednn_bf16_available(), cpu_matmul)
    logger.info("matmuls: %s (%s on %s)", mm.value, dtype, dev)
    model = LlamaModel(
        config if shard is None else local_config(config, shard),
        weights,
        attention or TorchAttention(),
        max_positions or config.max_position_embeddings,
        matmul=mm,
        tp=tp,
    )
    if scheme is not WeightScheme.NONE:
        paths = {
            w.path.value for w in model.weights.layers[0].matrices() if isinstance(w, QuantLinear)
        }
        logger.info("quantized matmuls: %s", ", ".join(sorted(paths)))
    return model
