"""The bindings' error messages stream nothing but strings (``csrc/check_messages.h``).

On the H200 machine of 2026-11-30 (torch 2.11.0+cu130) an extension that wrote an integer into
a ``std::ostringstream`` segfaulted, so a ``TORCH_CHECK`` whose message streamed a number, a
shape (``t.sizes()``) or a device killed Python instead of raising. Every message argument of
every ``TORCH_CHECK*`` in ``csrc/*/binding.cpp`` must therefore be a string literal, a
``const char*`` parameter, or one of the header's string makers. Read from the sources: no
compiler needed.
"""

from __future__ import annotations

import re

import pytest

from kernelstudy.core.extensions import csrc_dir

BINDINGS = sorted(csrc_dir().glob("*/binding.cpp"))
# the string makers check_messages.h defines, and CUDA's error string (a const char*)
STRING_MAKERS = (
    *re.findall(r"^inline [^(]*?\b(\w+)\(", (csrc_dir() / "check_messages.h").read_text(), re.M),
    "cudaGetErrorString",
)
_CHECK = re.compile(r"\bTORCH_CHECK(?:_VALUE|_TYPE|_INDEX|_NOT_IMPLEMENTED)?\s*\(")


def _split_arguments(text: str, start: int) -> tuple[list[str], int]:
    """The top-level, comma-separated arguments of the call whose '(' is at ``start``, and
    the index after its ')'. Skips string and character literals and comments."""
    depth, args, current, i = 0, [], [], start
    while i < len(text):
        c = text[i]
        if c in "\"'":  # a literal, escapes included
            j = i + 1
            while text[j] != c:
                j += 2 if text[j] == "\\" else 1
            current.append(text[i : j + 1])
            i = j + 1
            continue
        if text.startswith("//", i):
            i = text.index("\n", i)
            continue
        if c == "(":
            depth += 1
            if depth == 1:
                i += 1
                continue
        elif c == ")":
            depth -= 1
            if depth == 0:
                args.append("".join(current).strip())
                return args, i + 1
        elif c == "," and depth == 1:
            args.append("".join(current).strip())
            current = []
            i += 1
            continue
        current.append(c)
        i += 1
    raise ValueError(f"unbalanced parentheses from offset {start}")


def unsafe_message_arguments(source: str) -> list[str]:
    """The message arguments of the ``TORCH_CHECK*`` calls in ``source`` that are not strings:
    not a string literal, a ``const char*`` named in ``source``, or a call of
    :data:`STRING_MAKERS`."""
    char_pointers = set(re.findall(r"const char\s*\*\s*(\w+)", source))
    bad = []
    for found in _CHECK.finditer(source):
        args, _ = _split_arguments(source, found.end() - 1)
        for arg in args[1:]:  # args[0] is the condition
            literal = re.fullmatch(r'(\s*"(?:[^"\\]|\\.)*"\s*)+', arg)
            maker = re.match(rf"({'|'.join(STRING_MAKERS)})\(", arg)
            if not (literal or maker or arg in char_pointers):
                bad.append(arg)
    return bad


@pytest.mark.parametrize("binding", BINDINGS, ids=lambda p: p.parent.name)
def test_the_bindings_messages_stream_only_strings(binding):
    bad = unsafe_message_arguments(binding.read_text())
    assert not bad, f"{binding}: message arguments that are not strings: {bad}"


def test_the_check_finds_numbers_shapes_and_devices():
    source = (
        "void f(const char* name, int64_t n, const at::Tensor& t) {\n"
        '  TORCH_CHECK_VALUE(n > 0, name, " must be positive, got ", n);  // a number\n'
        '  TORCH_CHECK_VALUE(t.dim() == 4, "got ", t.sizes(), " on ", t.device());\n'
        '  TORCH_CHECK_TYPE(t.is_cuda(), name, " got ", number(n), " (", shape(t.sizes()),\n'
        '                   ") ", device_name(t.device()), " ", dtype_name(t.scalar_type()));\n'
        '  TORCH_CHECK(g(h(n), 1), "a, b" "c", cudaGetErrorString(e));\n'
        "}\n"
    )
    assert unsafe_message_arguments(source) == ["n", "t.sizes()", "t.device()"]
