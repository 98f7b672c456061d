"""The codec's codebook lookups (`CodebookTables`): the official split quantizer's decode, its tables computed once.

The official `SplitResidualVectorQuantizer.decode` derives each codebook's table from the module's parameters in
every call (`embedding_sum / cluster_usage.clamp(min=epsilon)`: a clamp and a division of a [bins, dim] table per
codebook) and then sums the lookups one codebook at a time, starting from a zero: with the released 16 codebooks
some 65 kernel launches a codec call whatever its size, a fixed cost of every call (docs/gpu.md, "Codec
convolutions"). Here the tables are computed once, by the same ops on the same parameters, and each group's
lookups are summed in the same order in the same dtype, so the result is the official one but for the sign of a
zero (the official sum starts from +0). On a GPU each group's lookups and sums are one Triton kernel
(`kernels.codebooks`), four launches in all with the two projections and their sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import codebooks as codebook_kernel
from ...models.compat import OfficialModule


class CodebookTables:
    """`quantizer.decode` for codes [B, T, Q], with each codebook's table computed at construction."""

    def __init__(self, quantizer: OfficialModule) -> None:
        """`quantizer`: the decoder's official `SplitResidualVectorQuantizer` (the semantic codebooks' group and
        the acoustic ones', each with its output projection). Its parameters are read now: a model changed
        afterwards needs a new instance, as the codec's other precomputed weights do."""
        self._groups: list[tuple[int, torch.Tensor, nn.Module]] = []  # (first codebook, tables [n, bins, dim], projection)
        first = 0
        with torch.no_grad():
            for group in (quantizer.rvq_first, quantizer.rvq_rest):
                tables = []
                for layer in group.vq.layers:
                    if not isinstance(layer.project_out, nn.Identity):
                        raise ValueError("a codebook with a projection of its own is not supported")
                    book = layer._codebook
                    tables.append(book.embedding_sum / book.cluster_usage.clamp(min=book.epsilon)[:, None])
                self._groups.append((first, torch.stack(tables), group.output_proj))
                first += len(tables)
        self.num_quantizers = first
        # "triton", or "pytorch (why not)", as `runner.kernel_paths` reports a stack
        support = codebook_kernel.supports(self._groups[0][1])
        self.path = "triton" if support else f"pytorch ({support.reason})"
        self._fused = bool(support)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes [B, T, Q] (int64) -> the quantized latent [B, dim, T], as `quantizer.decode(codes.transpose(1, 2))`."""
        out: torch.Tensor | None = None
        for first, tables, projection in self._groups:
            if self._fused:
                summed = codebook_kernel.codebook_sum(codes, first, tables)
            else:
                summed = F.embedding(codes[..., first], tables[0])  # [B, T, dim]
                for i in range(1, len(tables)):
                    summed = summed + F.embedding(codes[..., first + i], tables[i])
            part = projection(summed.transpose(1, 2))
            out = part if out is None else out + part
        assert out is not None  # the quantizer has two groups
        return out
