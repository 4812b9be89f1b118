"""The include graph goes one way: no file includes a layer above its own.

The layers (docs/architecture.md), lowest first:
  common/   header-only helpers that depend on nothing of the project
  kernels/  the math: Problem, geometry, score transforms, the online softmax, the backends
  proto/    the contract and its helpers (may use kernels/'s dtype rules)
  server/   attnd (proto -> Problem -> kernels)          \  peers: neither includes
  client/   the client library, attn, merge, viewer       /  the other
tests/ may include anything. A quoted include's first path part names its layer; generated
headers (attention/..., grpc/health/...) belong to proto/. Anything else (absl, grpcpp, httplib,
google/protobuf) is outside the project.

Before checking the tree, the test checks itself on a small tree with one upward include and
fails if it does not catch it.

Usage: include_layers_test.py PROJECT_SOURCE_DIR
"""

import os
import re
import sys
import tempfile

# What each layer may include, by first path component.
ALLOWED = {
    "common": {"common"},
    "kernels": {"common", "kernels"},
    "proto": {"common", "kernels", "proto"},
    "server": {"common", "kernels", "proto", "server"},
    "client": {"common", "kernels", "proto", "client"},
}
GENERATED = {"attention": "proto", "grpc/health": "proto"}
SOURCE_SUFFIXES = (".h", ".cc", ".cu", ".inc", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def layer_of_include(path):
    """The project layer a quoted include names, or None for a header outside the project."""
    for prefix, layer in GENERATED.items():
        if path == prefix or path.startswith(prefix + "/"):
            return layer
    first = path.split("/", 1)[0]
    return first if first in ALLOWED else None


def violations(root):
    """[(file, line number, include, why)] for every include that goes up or sideways."""
    found = []
    for layer, allowed in ALLOWED.items():
        top = os.path.join(root, layer)
        for directory, subdirs, files in os.walk(top):
            subdirs[:] = [d for d in subdirs if d not in ("node_modules", "build")]
            for name in files:
                if not name.endswith(SOURCE_SUFFIXES):
                    continue
                path = os.path.join(directory, name)
                with open(path, encoding="utf-8", errors="replace") as source:
                    for number, line in enumerate(source, 1):
                        match = INCLUDE.match(line)
                        if not match:
                            continue
                        target = layer_of_include(match.group(1))
                        if target is not None and target not in allowed:
                            found.append((os.path.relpath(path, root), number, match.group(1),
                                          f"{layer}/ may not include {target}/"))
    return found


def self_test():
    """The checker must catch an upward include and a sideways one, and pass a clean tree."""
    with tempfile.TemporaryDirectory() as root:
        def write(relative, text):
            os.makedirs(os.path.dirname(os.path.join(root, relative)), exist_ok=True)
            with open(os.path.join(root, relative), "w") as out:
                out.write(text)

        write("kernels/ok.h", '#include "kernels/dtype.h"\n#include "absl/status/status.h"\n')
        write("client/ok.cc", '#include "proto/tensor_shape.h"\n#include "common/flags.h"\n')
        if violations(root):
            raise SystemExit(f"self-test: a clean tree was flagged: {violations(root)}")
        write("kernels/cpu/bad.cc", '#include "server/request.h"\n')
        write("client/cli/bad.cc", '  #  include "server/dashed_flags.h"\n')
        write("kernels/bad.cu", '#include "attention/v1/attention.pb.h"\n')
        caught = {v[0] for v in violations(root)}
        expected = {"kernels/cpu/bad.cc", "client/cli/bad.cc", "kernels/bad.cu"}
        if caught != expected:
            raise SystemExit(f"self-test: expected {sorted(expected)} flagged, got {sorted(caught)}")


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    self_test()
    found = violations(sys.argv[1])
    for path, number, include, why in found:
        print(f"{path}:{number}: #include \"{include}\": {why}")
    if found:
        raise SystemExit(f"include_layers_test: {len(found)} include(s) against the layers")
    print("include_layers_test: every include goes down the layers (self-test caught 3 of 3)")


if __name__ == "__main__":
    main()
