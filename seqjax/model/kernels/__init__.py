"""Attention kernels behind ``model.attention``: Pallas flash attention (GPU; interpret mode elsewhere) and the
TPU splash wrapper. Import the submodules directly (``seqjax.model.kernels.flash``, ``.splash``);
the dispatch in ``seqjax.model.attention`` does so lazily, so a platform without one still runs the
others."""
