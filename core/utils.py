"""Small arithmetic shared by the core and the backends."""

import hashlib


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of b hold a items."""
    return -(-a // b)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers, equal in every process and run: a digest, never hash(),
    whose value for a str or bytes changes with each interpreter start."""
    data = b"".join(int(p).to_bytes(16, "little", signed=True) for p in parts)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & 0x7FFF_FFFF_FFFF_FFFF
