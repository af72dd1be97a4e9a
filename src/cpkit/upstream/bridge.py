"""Megatron-Bridge's own code, loaded by file path from the checkout named by CPKIT_BRIDGE_SRC.

Bridge's package `__init__` imports its model zoo (transformers, diffusers, peft, ...), and
`training/config.py` and `training/initialize.py` import Megatron-LM's `megatron.training`
(not part of the megatron-core wheel) and a dozen Bridge data and model modules. The pieces
cpkit tests need (`ConfigContainer._validate_cp_comm_type`, `_create_pg_collection`,
`_initialize_distributed`, the `TransformerConfig` whose `finalize()` runs MCore's checks) only
need torch and megatron.core. So, without installing Bridge's dependencies:

- `load_module(relpath)` executes one Bridge file whole, its `megatron.bridge` imports loaded the
  same way (for files such as `models/transformer_config.py` that import megatron.core only);
- `load_functions(relpath)` takes the file's top-level functions and class methods from its
  syntax tree and compiles them against the file's imports, each import statement run on its
  own; a name whose import fails here is bound to a `MissingImport` that raises ImportError
  naming the import the moment a Bridge function reaches it. So a test either runs Bridge's
  real code or fails saying which import it would need; nothing of Bridge is rewritten.

Without CPKIT_BRIDGE_SRC, an importable `megatron.bridge` (the released package) is used;
without either, `bridge_src()` gives the skip reason.

On top of the loader, what a loop that runs Bridge's initialization needs: `bridge_modules()`
(Bridge's TransformerConfig, its cp_comm_type check, `_initialize_distributed`,
`_create_pg_collection`), `bridge_model_config()` (a finalized, checked Bridge model config) and
`DistInit` (the `cfg.dist` fields `_initialize_distributed` reads).
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import os
import subprocess
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from cpkit.errors import CPConfigError

__all__ = [
    "BRIDGE_SRC_ENV",
    "DistInit",
    "MissingImport",
    "bridge_model_config",
    "bridge_modules",
    "bridge_commit",
    "bridge_src",
    "load_functions",
    "load_module",
    "missing_imports",
]

BRIDGE_SRC_ENV = "CPKIT_BRIDGE_SRC"
"""Environment variable: the path of a Megatron-Bridge checkout's `src/` directory."""

_MARKER = Path("megatron/bridge/training/initialize.py")  # a file every Bridge src/ has


def bridge_src(marker: Path = _MARKER) -> tuple[Optional[Path], str]:
    """(Bridge's src/ directory, "") or (None, why not: the skip reason): CPKIT_BRIDGE_SRC, else
    the directory of an importable `megatron.bridge`, either holding the file `marker`.

    Raises CPConfigError when CPKIT_BRIDGE_SRC is set to a directory without `marker`."""
    src = os.environ.get(BRIDGE_SRC_ENV)
    if src:
        path = Path(src).expanduser()
        if not (path / marker).is_file():
            raise CPConfigError.single(
                BRIDGE_SRC_ENV, src, f"must be a Megatron-Bridge src/ directory containing {marker}",
                f"point {BRIDGE_SRC_ENV} at <Megatron-Bridge checkout>/src, or unset it to skip Bridge")
        return path, ""
    try:
        spec = importlib.util.find_spec("megatron.bridge")
    except (ImportError, ValueError):
        spec = None
    for location in (spec.submodule_search_locations or []) if spec else []:
        root = Path(location).parent.parent
        if (root / marker).is_file():
            return root, ""
    return None, f"Megatron-Bridge not found: set {BRIDGE_SRC_ENV} to a checkout's src/ directory"


def bridge_commit(src: Path) -> str:
    """The short git commit of the checkout holding `src`; without git, or for a tree whose .git
    holds only HEAD (an archive unpacked with its commit, as scripts/upstream-unpack.sh does),
    cpkit.upstream.checkouts.checkout_identity: the commit read from .git, else "content-<hash>" of a
    copy's Python files."""
    try:
        out = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10, check=False)
        found = out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        found = ""
    if found:
        return found
    from cpkit.upstream.checkouts import checkout_identity

    identity = checkout_identity(src)
    return identity if identity.startswith("content-") else identity[:9]


class MissingImport:
    """Stands for a name whose import failed here; any use raises ImportError naming it."""

    def __init__(self, name: str, statement: str, error: BaseException):
        self._what = f"{name!r} (`{statement}`) is not importable here: {type(error).__name__}: {error}"

    def _fail(self, *args, **kwargs):
        raise ImportError(f"the Bridge code under test reached {self._what}")

    __call__ = _fail

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        self._fail()

    def __repr__(self):
        return f"<MissingImport {self._what}>"


def _module_name(src: Path, relpath: str, kind: str) -> str:
    digest = hashlib.sha1(f"{src.resolve()}:{relpath}:{kind}".encode()).hexdigest()[:12]
    return f"_cpkit_bridge_{kind}_{digest}"


def _bridge_relpath(module: str) -> Optional[str]:
    """'megatron.bridge.a.b' -> 'megatron/bridge/a/b.py' (None for other modules)."""
    if module != "megatron.bridge" and not module.startswith("megatron.bridge."):
        return None
    return module.replace(".", "/") + ".py"


def _module_relpath(src: Path, module: str) -> str:
    """The file of megatron.bridge module `module` under `src` (a package's __init__.py)."""
    relpath = _bridge_relpath(module)
    package = relpath[:-3] + "/__init__.py"
    if (src / relpath).is_file():
        return relpath
    if (src / package).is_file():
        return package
    raise ModuleNotFoundError(f"no {relpath} or {package} under {src}", name=module)


def _import_bridge_module(src: Path, module: str) -> Any:
    """A megatron.bridge module by path, executed whole (for load_module's imports)."""
    return load_module(_module_relpath(src, module), src=src)


def load_module(relpath: str, *, src: Optional[Path] = None) -> types.ModuleType:
    """Execute Bridge's file `relpath` (e.g. "megatron/bridge/models/transformer_config.py") as
    a module of its own, its `megatron.bridge` imports loaded by path too. Raises ImportError
    when the file imports something this Python lacks."""
    src = src or _require_src()
    name = _module_name(src, relpath, "module")
    if name in sys.modules:
        return sys.modules[name]
    path = src / relpath
    module = types.ModuleType(name)
    module.__file__ = str(path)
    module.__dict__["__builtins__"] = _builtins_with_bridge_import(src)
    sys.modules[name] = module
    try:
        exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _builtins_with_bridge_import(src: Path) -> dict:
    """builtins whose __import__ resolves megatron.bridge modules from `src` by path."""
    import builtins

    real_import = builtins.__import__

    def bridge_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and _bridge_relpath(name) and fromlist:
            return _import_bridge_module(src, name)
        return real_import(name, globals, locals, fromlist, level)

    table = dict(vars(builtins))
    table["__import__"] = bridge_import
    return table


def load_functions(relpath: str, names: list[str], *, src: Optional[Path] = None) -> types.SimpleNamespace:
    """Bridge's functions `names` from file `relpath`: top-level functions by name, class
    methods as "Class.method" (plain functions taking `self` first, decorators dropped),
    compiled from the file's syntax tree against what they use: the other top-level functions
    they call and the imports that bind the names they read. Only those import statements run,
    each on its own; a `megatron.bridge` name is taken the same way from its own file (or that
    file executed whole, for a class). A name whose import fails here is a MissingImport (see
    `missing_imports`); module-level constants and classes of `relpath` are not run."""
    src = src or _require_src()
    key = _module_name(src, relpath + ":" + ",".join(sorted(names)), "functions")
    if key in _FUNCTION_CACHE:
        return _FUNCTION_CACHE[key]
    path = src / relpath
    tree = ast.parse(path.read_text(), str(path))
    functions, imports = _top_level(tree)
    wanted = _closure(names, functions)
    scope: dict[str, Any] = {"__builtins__": __builtins__, "__name__": key, "__file__": str(path)}
    missing: dict[str, str] = {}
    for name in sorted({n for fn in wanted for n in _free_names(functions[fn])} & imports.keys()):
        _bind_import(name, imports[name], scope, src, path, missing)
    namespace = types.SimpleNamespace()
    for fn in sorted(wanted, key=lambda n: "." in n):  # top-level first: methods get a copy of scope
        node = functions[fn]
        compiled = _compile_function(node, scope if "." not in fn else dict(scope), path)
        setattr(namespace, fn, compiled)
    for name, value in scope.items():
        if not name.startswith("__") and not hasattr(namespace, name):
            setattr(namespace, name, value)
    namespace.__missing_imports__ = missing
    namespace.__file__ = str(path)
    _FUNCTION_CACHE[key] = namespace
    return namespace


_FUNCTION_CACHE: dict[str, types.SimpleNamespace] = {}


def _top_level(tree: ast.Module) -> tuple[dict[str, ast.AST], dict[str, tuple[ast.stmt, ast.alias]]]:
    """(function name or "Class.method" -> node, bound name -> (import statement, alias))."""
    functions: dict[str, ast.AST] = {}
    imports: dict[str, tuple[ast.stmt, ast.alias]] = {}
    for node in tree.body:
        for statement in _import_statements(node):
            for alias in statement.names:
                imports.setdefault(alias.asname or alias.name.split(".")[0], (statement, alias))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    item.decorator_list = []  # property/setter decorators need the class body
                    functions[f"{node.name}.{item.name}"] = item
    return functions, imports


def _free_names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _closure(names: list[str], functions: dict[str, ast.AST]) -> set[str]:
    unknown = [n for n in names if n not in functions]
    if unknown:
        raise AttributeError(f"no function {unknown} in the Bridge file (have {sorted(functions)[:20]}...)")
    wanted, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in wanted:
            continue
        wanted.add(name)
        todo += [n for n in _free_names(functions[name]) if n in functions and n not in wanted]
    return wanted


def _bind_import(name: str, entry: tuple[ast.stmt, ast.alias], scope: dict, src: Path, path: Path,
                 missing: dict[str, str]) -> None:
    statement, alias = entry
    text = ast.unparse(statement)
    try:
        if isinstance(statement, ast.ImportFrom) and statement.level == 0 and _bridge_relpath(statement.module or ""):
            scope[name] = _bridge_name(src, statement.module, alias.name)
        elif isinstance(statement, ast.ImportFrom):
            module = importlib.import_module(statement.module)
            try:
                scope[name] = getattr(module, alias.name)
            except AttributeError:
                scope[name] = importlib.import_module(f"{statement.module}.{alias.name}")
        else:
            module = importlib.import_module(alias.name)
            scope[name] = module if alias.asname else importlib.import_module(alias.name.split(".")[0])
    except Exception as err:  # noqa: BLE001 - any failure of an import is recorded
        scope[name] = MissingImport(name, text, err)
        missing[name] = f"{text}: {type(err).__name__}: {err}"


def _bridge_name(src: Path, module: str, attr: str) -> Any:
    """`attr` of Bridge module `module`: a function or re-exported import from its syntax tree,
    else (a class, a constant) from the file executed whole."""
    relpath = _module_relpath(src, module)
    functions, imports = _top_level(ast.parse((src / relpath).read_text()))
    if attr in functions:
        return getattr(load_functions(relpath, [attr], src=src), attr)
    if attr in imports:
        scope: dict[str, Any] = {}
        missing: dict[str, str] = {}
        _bind_import(attr, imports[attr], scope, src, src / relpath, missing)
        if missing:
            raise ImportError(missing[attr])
        return scope[attr]
    return getattr(load_module(relpath, src=src), attr)


def missing_imports(namespace: types.SimpleNamespace) -> dict[str, str]:
    """name -> why, for every import of a `load_functions` file that failed here."""
    return dict(namespace.__missing_imports__)


def _require_src() -> Path:
    src, why = bridge_src()
    if src is None:
        raise ImportError(why)
    return src


def _import_statements(node: ast.stmt) -> list[ast.stmt]:
    """Top-level imports, also those inside a top-level try/if (e.g. optional imports)."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [node]
    if isinstance(node, (ast.Try, ast.If)):
        return [s for child in node.body for s in _import_statements(child)]
    return []


def _compile_function(node: ast.AST, scope: dict, path: Path) -> Any:
    code = compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec")
    exec(code, scope)
    return scope[node.name]


def bridge_modules() -> types.SimpleNamespace:
    """Bridge's checks loaded from the checkout: `.TransformerConfig` (Bridge's class),
    `.validate_cp_comm_type(self)`, `.create_pg_collection(...)`, `.initialize_distributed(...)`,
    `.src` and `.commit`. Raises ImportError with the skip reason when Bridge is not there."""
    src, why = bridge_src()
    if src is None:
        raise ImportError(why)
    model = load_module("megatron/bridge/models/transformer_config.py", src=src)
    config = load_functions("megatron/bridge/training/config.py", ["ConfigContainer._validate_cp_comm_type"], src=src)
    init = load_functions("megatron/bridge/training/initialize.py", ["_initialize_distributed", "_create_pg_collection"],
                          src=src)
    return types.SimpleNamespace(
        TransformerConfig=model.TransformerConfig,
        MLATransformerConfig=model.MLATransformerConfig,
        validate_cp_comm_type=getattr(config, "ConfigContainer._validate_cp_comm_type"),
        create_pg_collection=init._create_pg_collection,
        initialize_distributed=init._initialize_distributed,
        missing_imports=missing_imports(init),
        src=src,
        commit=bridge_commit(src),
    )


@dataclass
class DistInit:
    """The fields of Bridge's `cfg.dist` (`megatron.bridge.training.config.DistributedInitConfig`,
    a subclass of Megatron-LM's `megatron.training.config.DistributedInitConfig`, which is not in
    the megatron-core wheel) that `_initialize_distributed` reads on the MPU path once
    torch.distributed is initialized, with their defaults there; the backend is the launch's."""

    distributed_backend: str = "nccl"
    use_decentralized_pg: bool = False
    distributed_timeout_minutes: int = 10
    nccl_communicator_config_path: Optional[str] = None
    use_tp_pp_dp_mapping: bool = False
    use_gloo_process_groups: bool = True
    use_sharp: bool = False
    sharp_enabled_group: Optional[str] = None
    high_priority_stream_groups: list = field(default_factory=list)
    external_gpu_device_mapping: bool = False


def bridge_model_config(bridge: types.SimpleNamespace, **kwargs: Any) -> Any:
    """Bridge's TransformerConfig (MLATransformerConfig with multi_latent_attention=True) from
    keyword fields, finalized (MCore's __post_init__ run) and passed through
    ConfigContainer._validate_cp_comm_type, as ConfigContainer.validate does."""
    cls = bridge.MLATransformerConfig if kwargs.get("multi_latent_attention") else bridge.TransformerConfig
    config = cls(**kwargs)
    config.finalize()
    bridge.validate_cp_comm_type(types.SimpleNamespace(model=config))
    return config
