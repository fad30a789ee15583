"""`ort-lora` command line: export, serve, bench. Each subcommand lives with its feature."""

from __future__ import annotations

import importlib
import sys
from importlib.metadata import version

SUBCOMMANDS = {
    "export": ("ort_lora.export.cli", "Export a Hugging Face checkpoint or GGUF file to ONNX"),
    "serve": ("ort_lora.server.cli", "Serve a model and its adapters over the OpenAI API"),
    "bench": ("ort_lora.bench.cli", "Benchmark ort-lora against other systems"),
}


def usage() -> str:
    lines = ["usage: ort-lora [--version] {" + ",".join(SUBCOMMANDS) + "} ...", "", "commands:"]
    lines += [f"  {name:8s} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"ort-lora {version('ort-lora')}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"ort-lora: unknown command '{name}'\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
