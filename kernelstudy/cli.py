"""The ``kernelstudy`` command: inspect backends and maps, run studies, benchmarks and searches.

Exit codes: 0 success; 1 a run failed, or a value was refused after parsing (a bad
size, a busy or foreign output folder), with a one-line message; 2 the command line
does not parse (argparse's convention); 130 interrupted by Ctrl-C; 141 the output was piped
into a reader that stopped (``| head``: 128 + SIGPIPE, as a killed writer's).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

import kernelstudy as ks
from kernelstudy.arguments import nonempty_user_path
from kernelstudy.progress import (
    INTERRUPTED_RESUMABLE,
    closed_pipe_exit,
    usable_output_streams,
    warnings_above_bars,
)


def _cmd_backends(args: argparse.Namespace) -> int:
    from kernelstudy.core.backends import registered_backends

    available = set(ks.backends())
    rows = []
    for name, backend in registered_backends().items():
        mark = "yes" if name in available else "no"
        rows.append((name, mark, str(backend.priority), backend.description))
    _print_table(("backend", "available", "priority", "description"), rows)
    return 0


def _cmd_maps(args: argparse.Namespace) -> int:
    from kernelstudy.feature_maps import feature_map_table

    table = feature_map_table()
    if args.pattern:
        names = set(ks.list_feature_maps(args.pattern))
        if not names:
            raise ValueError(
                f"no feature map matches {args.pattern!r} "
                f"(known: {', '.join(ks.list_feature_maps())})"
            )
        table = table[table["name"].isin(names)]
    if args.format == "csv":
        table.to_csv(sys.stdout, index=False)
    else:
        cols = list(table.columns)
        _print_table(cols, [tuple(str(v) for v in row) for row in table.itertuples(index=False)])
    return 0


def _cmd_study(args: argparse.Namespace) -> int:
    from kernelstudy.study import list_studies, run_from_args

    if args.name in list_studies():
        run_from_args(args.name, args)
        return 0
    # the searches' names (a third of a second of imports: optuna, the trainer) where asked
    from kernelstudy.search.pipeline import list_search_studies, run_search_study

    if args.name is None:
        options = ("quick", "force", "fill_tables", "only", "out", "config")
        given = [f"--{k.replace('_', '-')}" for k in options if getattr(args, k)]
        given += ["--device"] if args.device != "cpu" else []
        if given:  # options without a study: say so rather than list and ignore them
            raise ValueError(f"{', '.join(given)} need(s) a study NAME (kernelstudy study NAME)")
        for name in list_studies():
            print(name)
        for name in list_search_studies():
            print(f"{name} (a search: search, evaluate, report)")
        return 0
    if args.name in list_search_studies():
        options = ("force", "fill_tables", "only", "config")
        given = [f"--{k.replace('_', '-')}" for k in options if getattr(args, k)]
        if given:  # a search resumes by itself; its variants are chosen by `kernelstudy search`
            raise ValueError(
                f"{', '.join(given)} do(es) not apply to {args.name!r}, a search "
                f"(kernelstudy search/evaluate/report studies/{args.name}.toml take its options)"
            )
        paths = run_search_study(args.name, quick=args.quick, out=args.out, device=args.device)
        print(paths["table_md"].read_text(encoding="utf-8"), end="")
        for key, path in paths.items():
            print(f"{key}: {path}")
        return 0
    run_from_args(args.name, args)
    return 0


#: ``write_listops`` arguments and the ``kernelstudy data listops`` flags that set them.
LISTOPS_FLAGS = {
    "n_train": "--train",
    "n_val": "--val",
    "n_test": "--test",
    "min_length": "--min-length",
    "max_length": "--max-length",
    "seed": "--seed",
}


def _cmd_data_listops(args: argparse.Namespace) -> int:
    from kernelstudy.tasks import write_listops

    try:
        paths = write_listops(
            args.out,
            n_train=args.train,
            n_val=args.val,
            n_test=args.test,
            min_length=args.min_length,
            max_length=args.max_length,
            seed=args.seed,
            progress=True,
            overwrite=args.overwrite,
        )
    except FileExistsError as err:
        raise FileExistsError(
            str(err).replace("overwrite=True (--overwrite)", "--overwrite")
        ) from None
    except ValueError as err:  # name the flags, not write_listops' arguments
        message = str(err)
        for name, flag in LISTOPS_FLAGS.items():
            message = re.sub(rf"\b{name}\b", flag, message)
        raise ValueError(message) from err
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0


def _print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Plain-text table with columns padded to their widest cell."""
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = "  ".join(str(h).ljust(w) for h, w in zip(header, widths, strict=True))
    print(line.rstrip())
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``kernelstudy`` command."""
    parser = argparse.ArgumentParser(
        prog="kernelstudy",
        description="Study kernelized (linear) attention: feature maps, core backends, "
        "analyses, studies and searches.",
    )
    parser.add_argument("--version", action="version", version=f"kernelstudy {ks.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("backends", help="list the linear-attention core backends")
    p.set_defaults(func=_cmd_backends)

    p = sub.add_parser("maps", help="list the feature-map registry")
    p.add_argument("pattern", nargs="?", help="glob pattern on map names, e.g. 'favor*'")
    p.add_argument(
        "--format",
        choices=("table", "csv"),
        default="table",
        help="plain-text table or CSV on stdout (default %(default)s)",
    )
    p.set_defaults(func=_cmd_maps)

    from kernelstudy.study import add_arguments

    p = sub.add_parser("study", help="run a study (no NAME: list the studies)")
    p.add_argument(
        "name",
        nargs="?",
        metavar="NAME",
        help="e.g. approximation, rank, speed; or a search config's, e.g. lra_listops: "
        "search, evaluate and report in turn (its --out: the searches' results folder, "
        "OUT/NAME of the config)",
    )
    add_arguments(p)
    p.set_defaults(func=_cmd_study)

    p = sub.add_parser("data", help="generate or prepare task data")
    data = p.add_subparsers(dest="dataset", metavar="DATASET", required=True)
    p = data.add_parser("listops", help="generate ListOps in the LRA release's TSV format")
    p.add_argument(
        "--out",
        required=True,
        type=nonempty_user_path,
        help="directory for basic_{train,val,test}.tsv",
    )
    p.add_argument(
        "--train", type=int, default=96_000, help="training examples (default %(default)s)"
    )
    p.add_argument(
        "--val", type=int, default=2_000, help="validation examples (default %(default)s)"
    )
    p.add_argument("--test", type=int, default=2_000, help="test examples (default %(default)s)")
    p.add_argument(
        "--min-length",
        type=int,
        default=500,
        help="sequences are longer than this many tokens, as in LRA (default %(default)s)",
    )
    p.add_argument(
        "--max-length",
        type=int,
        default=2000,
        help="sequences are shorter than this many tokens, as in LRA (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument(
        "--overwrite", action="store_true", help="replace basic_*.tsv files already in --out"
    )
    p.set_defaults(func=_cmd_data_listops)

    from kernelstudy.train.commands import add_commands as add_train_commands

    add_train_commands(sub)

    from kernelstudy.search.commands import add_commands as add_search_commands

    add_search_commands(sub)

    return parser


def out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocation failure (Python's, or torch's on a CPU or a GPU,
    also a size whose byte count overflows: a model width of 2^62)."""
    text = str(err).lower()
    return (
        isinstance(err, MemoryError)
        or type(err).__name__ == "OutOfMemoryError"
        or "can't allocate memory" in text
        or "out of memory" in text
        or "storage size calculation overflowed" in text
        or "integer multiplication overflow" in text
    )


def error_text(err: BaseException) -> str:
    """``err``'s message for a one-line error; an error raised in a DataLoader worker (torch
    re-raises it as "Caught ValueError in DataLoader worker process 1." and the worker's
    traceback) as the worker's own message, its last line."""
    text = str(err)
    if text.startswith("Caught ") and "DataLoader worker process" in text.split("\n", 1)[0]:
        last = [line for line in text.splitlines() if line.strip()][-1]
        prefix = f"{type(err).__name__}: "
        return last.removeprefix(prefix)
    return text


#: Commands whose finished work a Ctrl-C keeps and a rerun goes on from (said on Ctrl-C)
RESUMABLE_COMMANDS = frozenset({"train", "study", "search", "evaluate"})


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    usable_output_streams()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):  # a usage error: help to stderr, as argparse's errors
        parser.print_help(sys.stderr)
        return 2
    try:
        with warnings_above_bars():
            code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, not at exit: a pipe or file's buffered output fails here
        return code
    except BrokenPipeError:  # output piped into a reader that stopped (`| head`): quiet
        return closed_pipe_exit()
    except (ValueError, TypeError, OSError) as err:  # OSError: files (--out, --data, ...)
        print(f"kernelstudy {args.command}: error: {error_text(err)}", file=sys.stderr)
        return 1
    except (RuntimeError, MemoryError) as err:  # torch's allocation failures: no traceback
        if not out_of_memory(err):
            raise
        first = (str(err).strip().splitlines() or [type(err).__name__])[-1]
        print(
            f"kernelstudy {args.command}: error: out of memory ({first}); use smaller sizes",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        resumable = args.command in RESUMABLE_COMMANDS
        print(INTERRUPTED_RESUMABLE if resumable else "interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
