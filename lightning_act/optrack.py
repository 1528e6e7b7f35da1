"""Which torch function is running when autograd packs a saved tensor.

A saved tensor's ``grad_fn`` cannot tell a ReLU saving its output from the next layer saving the same tensor
as its input; the function being called can. While a :class:`FunctionTracker` is active, each function it
tracks (the op rules' and the weight-taking products: a few dozen) is replaced where code looks it up
(``torch.nn.functional``, ``torch``, ``torch.linalg``, ``torch.special``, ``torch.Tensor``, the function's own
module; for an autograd Function's ``apply``, the Function's class) by a wrapper that records its call in the
running thread's tracker, so the pack hook, which fires inside the call, sees it; a tracker's replacement of a
function runs in the call's place (a scatter max that saves masks, not values). Every other torch call runs
untouched. (A ``TorchFunctionMode`` sees every call: it took 1.5-5.8 ms a forward of the proxy models on this
project's CPU where the wrappers took 0.7-1.0, ``benchmarks/bench_host_overhead.py --tracking``.)

The outermost tracked call is reported: ``F.relu`` calling ``torch.relu``, or ``nn.MaxPool2d`` calling
``F.max_pool2d`` and ``torch.max_pool2d``, show up as the first. Threads without an active tracker call
straight through. The wrappers stay installed while any thread's tracker is active and are removed after the
last one exits, an attribute someone else replaced meanwhile left as it is.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple

import torch
import torch.nn.functional as F


class FunctionCall(NamedTuple):
    """The torch function being executed and the arguments it was called with."""

    func: Callable
    args: tuple
    kwargs: dict


# A model compiled where the engine cannot see it (``torch.compile(model)`` around the module a compressor was built
# on) calls the wrappers while dynamo traces it, or from the eager code between its graph breaks: traced, a call goes
# into the graph as it is (``_compiling`` is True then); from eager code, the wrapper's own frame is never compiled
# (the call under it is, as it would be without the wrapper)
_compiling = torch.compiler.is_compiling
_skip_frame = getattr(getattr(torch._dynamo, "eval_frame", None), "skip_code", None)
_THREAD = threading.local()  # .tracker: this thread's active FunctionTracker
_ORIGINAL = "_lightning_act_tracked"  # a wrapper's attribute: the function it records


def original(func: Callable) -> Callable:
    """``func``, or the function it records if it is a tracker's wrapper (looked up while one is installed)."""
    return getattr(func, _ORIGINAL, func)


def _wrapper(func: Callable) -> Callable:
    @functools.wraps(func)
    def tracked(*args, **kwargs):
        if _compiling():
            return func(*args, **kwargs)
        tracker = getattr(_THREAD, "tracker", None)
        if tracker is None or tracker.current is not None or func not in tracker.functions:
            return func(*args, **kwargs)  # another thread's call, one inside a tracked call, or not this tracker's
        tracker.current = FunctionCall(func, args, kwargs)
        try:
            replacement = tracker.replacements.get(func)
            if replacement is not None:
                out = replacement(func, args, kwargs)
                if out is not NotImplemented:
                    return out
            return func(*args, **kwargs)
        finally:
            tracker.current = None

    setattr(tracked, _ORIGINAL, func)
    if _skip_frame is not None:  # (one code object for every wrapper)
        _skip_frame(tracked.__code__)
    return tracked


@contextlib.contextmanager
def reported_call(func: Callable, args: tuple, kwargs: dict) -> Iterator[None]:
    """Report a call of ``func`` to this thread's tracker while the block runs, as ``func``'s wrapper would, for
    calls through a reference the tracker cannot replace (HuggingFace layers hold the checkpoint function they
    were handed). Nothing happens without a tracker or inside a tracked call."""
    tracker = getattr(_THREAD, "tracker", None)
    if tracker is None or tracker.current is not None:
        yield
        return
    tracker.current = FunctionCall(original(func), args, kwargs)  # (a name looked up now may be its wrapper)
    try:
        yield
    finally:
        tracker.current = None


# The namespaces code looks torch functions up in (besides ``torch.Tensor`` and a function's own module)
LOOKUP_MODULES = (F, torch, torch.linalg, torch.special)


def patch_sites(func: Callable) -> list[tuple[object, str]]:
    """Where code looks ``func`` up: ``(owner, name)`` in ``LOOKUP_MODULES``, ``torch.Tensor``, the function's own
    module and, for a method, its class there, whose attribute is ``func`` (aliases included: ``F.conv2d`` is
    ``torch.conv2d``); for a classmethod bound to a class (an autograd Function's ``apply``, which it inherits),
    that class."""
    if inspect.ismethod(func) and isinstance(func.__self__, type):
        return [(func.__self__, func.__name__)]  # a call through the class finds the wrapper set there
    owners = list(LOOKUP_MODULES)
    module = sys.modules.get(getattr(func, "__module__", None) or "")
    if module is not None and module not in owners:
        owners.append(module)
        # a method: the class of its module that defines it (torch.utils.checkpoint's _CheckpointFrame.save_inputs)
        owner = module
        for part in getattr(func, "__qualname__", "").split(".")[:-1]:
            owner = vars(owner).get(part) if isinstance(owner, type) or owner is module else None
        if isinstance(owner, type):
            owners.append(owner)
    # a module's own dict (its attribute lookup could import a lazy submodule); a class's attributes, inherited
    # ones included (Tensor.relu is TensorBase's)
    sites = [(owner, name) for owner in owners for name, value in list(vars(owner).items())
             if original(value) is func]
    return sites + [(torch.Tensor, name) for name in dir(torch.Tensor) if _class_attribute(name) is func]


def _class_attribute(name: str) -> Any:
    try:
        return original(getattr(torch.Tensor, name))
    except AttributeError:  # a descriptor that refuses the class
        return None


class _Wrappers:
    """The installed wrappers: a count of active trackers; the first installs, the last removes them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0
        # (owner, name) -> (the wrapper set there, what was there: the attribute of owner's own dict, or None)
        self.installed: dict[tuple[object, str], tuple[Callable, Any]] = {}
        self.functions: set[Callable] = set()
        # per function, made once: where it is looked up, and its wrapper (a step installs them, not builds them)
        self._sites: dict[Callable, tuple[list[tuple[object, str]], Callable]] = {}
        # per set of functions, made once: ((owner, name), owner, name, wrapper, owner is a class) for every site
        self._plans: dict[frozenset[Callable], tuple[tuple, ...]] = {}

    def _plan(self, functions: frozenset[Callable]) -> tuple[tuple, ...]:
        plan = self._plans.get(functions)
        if plan is None:
            steps = []
            for func in functions:
                found = self._sites.get(func)
                if found is None:
                    found = self._sites[func] = (patch_sites(func), _wrapper(func))
                sites, wrapper = found
                steps += [((owner, name), owner, name, wrapper, isinstance(owner, type)) for owner, name in sites]
            if len(self._plans) >= 16:  # (a few sets per process: with and without masks, tests' own)
                self._plans.clear()
            plan = self._plans[functions] = tuple(steps)
        return plan

    def enter(self, functions: frozenset[Callable]) -> None:
        with self.lock:
            self.active += 1
            # the first tracker installs its set; a later one, what it adds (a rule registered since)
            wanted = functions - self.functions if self.functions else functions
            if not wanted:
                return
            installed = self.installed
            for key, owner, name, wrapper, is_class in self._plan(frozenset(wanted)):
                installed[key] = (wrapper, vars(owner).get(name) if is_class else getattr(owner, name))
                setattr(owner, name, wrapper)
            self.functions |= wanted

    def exit(self) -> None:
        with self.lock:
            self.active -= 1
            if self.active:
                return
            for (owner, name), (wrapper, own) in self.installed.items():
                if getattr(owner, name, None) is not wrapper:
                    continue  # replaced by someone else since: theirs now
                if own is None:
                    delattr(owner, name)  # a class's inherited attribute: the base's shows again
                else:
                    setattr(owner, name, own)
            self.installed.clear()
            self.functions.clear()


_WRAPPERS = _Wrappers()


class FunctionTracker:
    """``current`` is the running call of one of ``functions`` in the thread that entered the tracker (``None``
    between such calls). A context manager, entered once at a time per thread (nested: the inner one tracks).

    ``replacements``: for some of ``functions``, ``replacement(func, args, kwargs)``, run in the call's place (while
    it is ``current``); its result stands for the call's, unless it returns ``NotImplemented``, and the function
    runs as it is."""

    def __init__(self, functions: Iterable[Callable],
                 replacements: Mapping[Callable, Callable[[Callable, tuple, dict], Any]] | None = None) -> None:
        self.functions = frozenset(functions)
        self.replacements = replacements or {}
        self.current: FunctionCall | None = None
        self._outer: FunctionTracker | None = None

    def __enter__(self) -> "FunctionTracker":
        _WRAPPERS.enter(self.functions)
        self._outer = getattr(_THREAD, "tracker", None)
        _THREAD.tracker = self
        return self

    def __exit__(self, *exc) -> None:
        _THREAD.tracker, self._outer = self._outer, None
        _WRAPPERS.exit()
