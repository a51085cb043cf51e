"""torchtitan's side of the ``memory_vs_torchtitan`` benchmark runs the shapes ray_titan's runs
(a child process reads torchtitan's flavors: its import needs the triton stub; skipped without
torchtitan, the ``bench`` extra)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import memory_vs_torchtitan as mvt


@pytest.mark.skipif(not mvt.torchtitan_available(), reason="torchtitan is not installed (the bench extra)")
def test_torchtitan_flavors_have_ray_titan_shapes():
    """torchtitan's flavor of each row has ray_titan's dims, layers, heads, FFN width and vocab
    (read in a child process: torchtitan's import needs the triton stub)."""
    code = (
        "import json, torch\n"
        "from benchmarks.torchtitan_cpu import install_triton_stub\n"
        "from benchmarks.memory_vs_torchtitan import FLAVORS, _stub_absent, _UNUSED_IMPORTS\n"
        "install_triton_stub(); _stub_absent(*_UNUSED_IMPORTS)\n"
        "import importlib\n"
        "out = {}\n"
        "for (m, f), (tm, tf) in FLAVORS.items():\n"
        "    c = importlib.import_module(f'torchtitan.models.{tm}').model_registry(tf).model\n"
        "    a = c.layers[0].attention\n"
        "    ffn = getattr(c.layers[0], 'feed_forward', None)\n"
        "    out[f'{m}/{f}'] = [c.dim, len(c.layers), c.vocab_size, a.n_heads,\n"
        "                       ffn.w1.out_features if ffn is not None else None]\n"
        "print(json.dumps(out))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    from ray_titan.models.registry import get_model_args

    for key, (dim, layers, vocab, heads, hidden) in got.items():
        args = get_model_args(*key.split("/"))
        assert (dim, layers, vocab, heads) == (args.dim, args.n_layers, args.vocab_size, args.n_heads), key
        if hidden is not None and hasattr(args, "ffn_hidden_dim"):
            assert hidden == args.ffn_hidden_dim, key
