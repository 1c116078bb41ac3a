"""bitsandbytes' 8-bit Adam/AdamW state bytes, as its Optimizer2State keeps them (shared by the
declarative and the dynamic-analysis tests)."""


def adam_8bit_state_bytes(sizes, fp32_sizes=()) -> int:
    """Tensors of ``sizes`` elements: two uint8 states plus an fp32 absmax per block of 256 from
    4,096 elements (min_8bit_size), two fp32 states below; ``fp32_sizes`` are kept in 32-bit states
    whatever their size (an optim_bits=32 override); plus the two quantization maps (256 fp32 codes
    each), copied to the GPU once."""
    eight = sum(2 * (n + 4 * -(-n // 256)) if n >= 4096 else 2 * 4 * n for n in sizes)
    return eight + sum(2 * 4 * n for n in fp32_sizes) + 2 * 256 * 4
