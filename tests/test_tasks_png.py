"""The stdlib PNG decoder: every filter, the common color types, and malformed files."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest

from kernelstudy.tasks import decode_png, read_png

CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}


def _chunk(kind: bytes, payload: bytes) -> bytes:
    return (
        struct.pack(">I", len(payload))
        + kind
        + payload
        + struct.pack(">I", zlib.crc32(kind + payload))
    )


def _predict(kind: int, a: int, b: int, c: int) -> int:
    if kind == 0:
        return 0
    if kind == 1:
        return a
    if kind == 2:
        return b
    if kind == 3:
        return (a + b) // 2
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else (b if pb <= pc else c)


def encode_png(
    pixels: np.ndarray,
    color_type: int = 0,
    bit_depth: int = 8,
    filters: tuple[int, ...] = (0,),
    palette: np.ndarray | None = None,
    interlace: int = 0,
) -> bytes:
    """A PNG of ``pixels`` ((H, W) or (H, W, C)), row ``y`` filtered with ``filters[y % len]``."""
    h, w = pixels.shape[:2]
    samples = pixels.reshape(h, w, -1)
    dtype = ">u2" if bit_depth == 16 else np.uint8
    rows = [samples[y].astype(dtype).tobytes() for y in range(h)]
    bpp = max(1, CHANNELS[color_type] * bit_depth // 8)
    out = bytearray()
    prior = bytes(len(rows[0]))
    for y, row in enumerate(rows):
        kind = filters[y % len(filters)]
        out.append(kind)
        for x, value in enumerate(row):
            a = row[x - bpp] if x >= bpp else 0
            c = prior[x - bpp] if x >= bpp else 0
            out.append((value - _predict(kind, a, prior[x], c)) % 256)
        prior = row
    data = zlib.compress(bytes(out))
    header = struct.pack(">IIBBBBB", w, h, bit_depth, color_type, 0, 0, interlace)
    png = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header)
    if palette is not None:
        png += _chunk(b"PLTE", palette.astype(np.uint8).tobytes())
    half = len(data) // 2  # two IDAT chunks, to check they are joined
    png += _chunk(b"IDAT", data[:half]) + _chunk(b"IDAT", data[half:])
    return png + _chunk(b"IEND", b"")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


@pytest.mark.parametrize("filters", [(0,), (1,), (2,), (3,), (4,), (0, 1, 2, 3, 4)])
def test_gray_every_filter(rng: np.random.Generator, filters: tuple[int, ...]) -> None:
    pixels = rng.integers(0, 256, (7, 5), dtype=np.uint8)
    decoded = decode_png(encode_png(pixels, 0, filters=filters))
    assert decoded.shape == (7, 5, 1)
    np.testing.assert_array_equal(decoded[..., 0], pixels)


@pytest.mark.parametrize("color_type", [2, 4, 6])
def test_color_types_with_mixed_filters(rng: np.random.Generator, color_type: int) -> None:
    pixels = rng.integers(0, 256, (6, 9, CHANNELS[color_type]), dtype=np.uint8)
    decoded = decode_png(encode_png(pixels, color_type, filters=(4, 3, 1, 2, 0)))
    np.testing.assert_array_equal(decoded, pixels)


def test_sixteen_bit_keeps_the_high_byte(rng: np.random.Generator) -> None:
    pixels = rng.integers(0, 65536, (4, 6), dtype=np.uint16)
    decoded = decode_png(encode_png(pixels, 0, bit_depth=16, filters=(1, 4, 3, 2)))
    np.testing.assert_array_equal(decoded[..., 0], (pixels >> 8).astype(np.uint8))


def test_palette(rng: np.random.Generator) -> None:
    palette = rng.integers(0, 256, (5, 3), dtype=np.uint8)
    index = rng.integers(0, 5, (3, 4), dtype=np.uint8)
    decoded = decode_png(encode_png(index, 3, filters=(1,), palette=palette))
    np.testing.assert_array_equal(decoded, palette[index])
    # a PLTE chunk of other than 1-256 triples failed as "cannot reshape array of size 7"
    for size in (0, 7, 771):
        bad = np.zeros(size, dtype=np.uint8)
        with pytest.raises(ValueError, match=f"bad PLTE chunk: {size} bytes, not 1-256 RGB"):
            decode_png(encode_png(index, 3, palette=bad))


def test_palette_index_equal_to_the_palette_size_is_refused(rng: np.random.Generator) -> None:
    """Indices run 0..len(palette) - 1: an index equal to the palette's size is a ValueError
    naming it (not an IndexError from numpy)."""
    palette = rng.integers(0, 256, (2, 3), dtype=np.uint8)
    index = np.array([[0, 1, 2]], dtype=np.uint8)
    with pytest.raises(ValueError, match="palette index out of range"):
        decode_png(encode_png(index, 3, palette=palette))


@pytest.mark.parametrize("mode", ["L", "RGB", "RGBA"])
def test_agrees_with_pillow(rng: np.random.Generator, mode: str) -> None:
    image_module = pytest.importorskip("PIL.Image")
    shape = (32, 32) if mode == "L" else (32, 32, len(mode))
    # Smooth content so Pillow's adaptive filtering picks varied filters.
    ramp = (np.add.outer(np.arange(32), np.arange(32)) * 4 % 256).astype(np.uint8)
    pixels = np.clip(
        ramp.reshape(32, 32, *([1] if mode != "L" else [])) + rng.integers(0, 3, shape), 0, 255
    )
    pixels = pixels.astype(np.uint8)
    buf = io.BytesIO()
    image_module.fromarray(pixels, mode).save(buf, format="PNG", optimize=True)
    decoded = decode_png(buf.getvalue())
    np.testing.assert_array_equal(decoded.reshape(pixels.shape), pixels)


def test_malformed_files_raise_value_error(tmp_path, rng: np.random.Generator) -> None:
    good = encode_png(rng.integers(0, 256, (4, 4), dtype=np.uint8))
    corrupt = bytearray(good)
    corrupt[40] ^= 0xFF  # inside the first IDAT payload: CRC mismatch
    cases = {
        "signature": b"GIF89a" + good[6:],
        "CRC": bytes(corrupt),
        "truncated": good[: len(good) // 2],
        "interlaced": encode_png(np.zeros((2, 2), np.uint8), interlace=1),
        "unsupported": encode_png(np.zeros((2, 2), np.uint8), bit_depth=4),
    }
    for name, data in cases.items():
        with pytest.raises(ValueError):
            decode_png(data)
        path = tmp_path / f"{name}.png"
        path.write_bytes(data)
        with pytest.raises(ValueError, match=str(path)):
            read_png(path)


def test_image_data_is_inflated_no_further_than_the_image() -> None:
    """The IDAT stream was inflated whole before its length was checked: a small file
    (here 50 KB for 50 MB of zeros) took as much memory as it expanded to. Decoding now
    stops one byte past the image's size; a stream that ends early or breaks off fails."""
    header = _chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 2, 8, 0, 0, 0, 0))
    end = _chunk(b"IEND", b"")

    def png(stream: bytes) -> bytes:
        return b"\x89PNG\r\n\x1a\n" + header + _chunk(b"IDAT", stream) + end

    bomb = png(zlib.compress(bytes(50_000_000), 9))
    assert len(bomb) < 100_000
    with pytest.raises(ValueError, match="more than the 6 bytes of the image"):
        decode_png(bomb)
    image = bytes([0, 1, 2, 0, 3, 4])  # two rows: filter byte, two pixels
    np.testing.assert_array_equal(decode_png(png(zlib.compress(image)))[..., 0], [[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="has 3 bytes, expected 6"):
        decode_png(png(zlib.compress(image[:3])))
    with pytest.raises(ValueError, match="incomplete or truncated"):
        decode_png(png(zlib.compress(image)[:-3]))
    with pytest.raises(TypeError, match="data must be the file's bytes, got str"):
        decode_png("\x89PNG")


def test_an_image_of_another_size_is_refused_before_it_is_inflated(tmp_path) -> None:
    """A 0.4 MB Pathfinder file claiming 20000x20000 pixels was inflated whole (1 GB, 4 s)
    before its size was compared with the resolution; one claiming the PNG maximum,
    (2^31 - 1)^2 RGBA pixels of 16 bits, gave zlib's OverflowError, naming no file."""

    def png(width: int, height: int, depth: int, color: int, stream: bytes) -> bytes:
        ihdr = struct.pack(">IIBBBBB", width, height, depth, color, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + _chunk(b"IHDR", ihdr)
            + _chunk(b"IDAT", stream)
            + _chunk(b"IEND", b"")
        )

    not_zlib = b"not a zlib stream"  # never inflated: the size is refused first
    with pytest.raises(ValueError, match=r"image is 20000x10000, expected 32x32"):
        decode_png(png(20000, 10000, 8, 0, not_zlib), shape=(32, 32))
    with pytest.raises(ValueError, match="corrupt image data"):
        decode_png(png(32, 32, 8, 0, not_zlib), shape=(32, 32))
    with pytest.raises(ValueError, match=r"2147483647x2147483647 pixels is too large to decode"):
        decode_png(png(2**31 - 1, 2**31 - 1, 16, 6, zlib.compress(bytes(9))))
    with pytest.raises(ValueError, match=r"2147483648x1 pixels, beyond 2\^31 - 1"):
        decode_png(png(2**31, 1, 8, 0, zlib.compress(bytes(9))))
    path = tmp_path / "a.png"
    path.write_bytes(encode_png(np.zeros((3, 5), np.uint8)))
    assert read_png(path, shape=(3, 5)).shape == (3, 5, 1)
    with pytest.raises(ValueError, match=r"a\.png: image is 5x3, expected 3x5"):
        read_png(path, shape=(5, 3))
