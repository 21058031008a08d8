"""megatron-bitpipe: BitPipe pipeline schedule and Optimus 2D tensor parallelism for megatron-core."""

__version__ = "0.1.0"
