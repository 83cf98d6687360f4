"""A small PNG decoder (standard library zlib + NumPy) for the Pathfinder images.

Reads non-interlaced PNGs of bit depth 8 (gray, gray+alpha, RGB, RGBA, palette)
or 16 (gray, gray+alpha, RGB, RGBA; the high byte is kept), with all five row
filters. That covers what image libraries write for 8-bit pictures.
"""

from __future__ import annotations

import struct
import sys
import zlib

import numpy as np

from .files import PathArg, check_path, data_error

SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # color type → samples per pixel
_MAX_SIDE = 2**31 - 1  # pixels: the PNG standard's largest width and height


def _chunks(data: bytes):
    """Yield ``(type, payload)`` for each chunk, checking lengths and CRCs."""
    pos = len(SIGNATURE)
    while pos < len(data):
        if pos + 8 > len(data):
            raise ValueError("truncated chunk header")
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        end = pos + 8 + length
        if end + 4 > len(data):
            raise ValueError(f"truncated {kind!r} chunk")
        payload = data[pos + 8 : end]
        (crc,) = struct.unpack(">I", data[end : end + 4])
        if zlib.crc32(kind + payload) != crc:
            raise ValueError(f"CRC mismatch in {kind!r} chunk")
        yield kind, payload
        if kind == b"IEND":
            return
        pos = end + 4
    raise ValueError("missing IEND chunk")


def _unfilter(raw: bytes, height: int, stride: int, bpp: int) -> np.ndarray:
    """Undo the per-row filters: raw scanlines → (height, stride) uint8."""
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(height, stride + 1)
    out = np.zeros((height, stride), dtype=np.uint8)
    prior = np.zeros(stride, dtype=np.uint8)
    for y in range(height):
        kind, line = rows[y, 0], rows[y, 1:]
        if kind == 0:
            cur = line.copy()
        elif kind == 1:  # Sub: running sum along each byte lane
            cur = np.cumsum(line.reshape(-1, bpp), axis=0, dtype=np.uint8).reshape(-1)
        elif kind == 2:  # Up
            cur = line + prior
        elif kind in (3, 4):  # Average, Paeth: sequential in x
            cur_list = line.tolist()
            up = prior.tolist()
            for x in range(stride):
                left = cur_list[x - bpp] if x >= bpp else 0
                if kind == 3:
                    pred = (left + up[x]) >> 1
                else:
                    upleft = up[x - bpp] if x >= bpp else 0
                    p = left + up[x] - upleft
                    pa, pb, pc = abs(p - left), abs(p - up[x]), abs(p - upleft)
                    pred = left if pa <= pb and pa <= pc else (up[x] if pb <= pc else upleft)
                cur_list[x] = (cur_list[x] + pred) & 0xFF
            cur = np.asarray(cur_list, dtype=np.uint8)
        else:
            raise ValueError(f"unknown filter type {kind} in row {y}")
        out[y] = cur
        prior = cur
    return out


def decode_png(data: bytes, shape: tuple[int, int] | None = None) -> np.ndarray:
    """Pixels of a PNG file's bytes: (H, W, C) uint8, C = 1 (gray), 2, 3 or 4 (alpha last).

    ``shape``: the (H, W) the image must have, checked before its data is inflated (a small
    file may claim gigapixels). Raises ValueError for malformed or unsupported files.
    """
    if not isinstance(data, bytes | bytearray):
        raise TypeError(f"data must be the file's bytes, got {type(data).__name__}")
    if not data.startswith(SIGNATURE):
        raise ValueError("not a PNG file (bad signature)")
    header = None
    palette = None
    idat = []
    for kind, payload in _chunks(data):
        if kind == b"IHDR":
            if len(payload) != 13:
                raise ValueError("bad IHDR chunk")
            header = struct.unpack(">IIBBBBB", payload)
        elif kind == b"PLTE":  # 1 to 256 RGB triples (the PNG standard: an error otherwise)
            if len(payload) % 3 or not 3 <= len(payload) <= 768:
                raise ValueError(f"bad PLTE chunk: {len(payload)} bytes, not 1-256 RGB triples")
            palette = np.frombuffer(payload, dtype=np.uint8).reshape(-1, 3)
        elif kind == b"IDAT":
            idat.append(payload)
    if header is None:
        raise ValueError("missing IHDR chunk")
    width, height, depth, color, compression, filtering, interlace = header
    if color not in _CHANNELS or depth not in (8, 16) or (color == 3 and depth != 8):
        raise ValueError(f"unsupported PNG: color type {color}, bit depth {depth}")
    if interlace or compression or filtering:
        raise ValueError("unsupported PNG: interlaced or non-standard compression/filter")
    if width == 0 or height == 0:
        raise ValueError("empty image")
    if width > _MAX_SIDE or height > _MAX_SIDE:  # the PNG standard's limit
        raise ValueError(f"bad IHDR chunk: {width}x{height} pixels, beyond 2^31 - 1")
    if shape is not None and (height, width) != tuple(shape):
        raise ValueError(f"image is {width}x{height}, expected {shape[1]}x{shape[0]}")
    channels = _CHANNELS[color]
    bpp = channels * depth // 8
    stride = width * bpp
    expected = height * (stride + 1)
    if expected >= sys.maxsize:  # zlib's own limit (an OverflowError, naming nothing)
        raise ValueError(f"image of {width}x{height} pixels is too large to decode")
    stream = zlib.decompressobj()
    try:  # at most one byte past the image: a small file may inflate to gigabytes
        raw = stream.decompress(b"".join(idat), expected + 1)
    except zlib.error as err:
        raise ValueError(f"corrupt image data ({err})") from err
    if len(raw) > expected:
        raise ValueError(f"image data holds more than the {expected} bytes of the image")
    if not stream.eof:
        raise ValueError("corrupt image data (incomplete or truncated stream)")
    if len(raw) != expected:
        raise ValueError(f"image data has {len(raw)} bytes, expected {expected}")
    pixels = _unfilter(raw, height, stride, bpp)
    if depth == 16:
        pixels = pixels[:, ::2]  # big-endian samples: keep the high byte
    pixels = pixels.reshape(height, width, channels)
    if color == 3:
        if palette is None:
            raise ValueError("palette image without a PLTE chunk")
        if pixels.max(initial=0) >= len(palette):
            raise ValueError("palette index out of range")
        pixels = palette[pixels[..., 0]]
    return pixels


def read_png(path: PathArg, shape: tuple[int, int] | None = None) -> np.ndarray:
    """(H, W, C) uint8 pixels of a PNG file; ValueError naming the file if it is malformed
    or not of ``shape`` (H, W), when given (see :func:`decode_png`)."""
    check_path("path", path)
    with open(path, "rb") as f:
        data = f.read()
    try:
        return decode_png(data, shape)
    except ValueError as err:
        raise data_error(path, str(err)) from None
