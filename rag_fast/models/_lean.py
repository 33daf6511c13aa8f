"""Lean activations: the same gradients from fewer saved tensors.

A training step's memory peak is where the backward pass starts: every tensor the forward pass
saved for it is alive at once. Some of them are cheap, exact functions of tensors that are
saved anyway, and this module stores the recipe instead of the tensor while the generator runs
(``torch.autograd.graph.saved_tensors_hooks``):

- **activation outputs** ``g = act(u)`` (GELU, SiLU, Mish and their ``transformers`` variants):
  the next linear layer saves ``g`` for its weight gradient, while the activation's own backward
  already saves ``u``. Stored: a reference to ``u``; the backward recomputes ``act(u)``.
- **gated products** ``p = act(u) * v`` (the SwiGLU / GeGLU feed-forward of Llama, Qwen2,
  Mistral and their kin), when an ``nn.Linear`` takes ``p``: the product's own backward keeps
  ``u``'s activation by recipe and ``v`` as it is. Stored: references to ``u`` and ``v``; the
  backward recomputes ``act(u) * v``.
- **normalisation outputs** ``y = norm(x)`` (``nn.LayerNorm``, ``nn.RMSNorm`` and the RMSNorm /
  T5 layer-norm modules of ``transformers``): the next linear layers save ``y``, the norm's
  backward saves ``x``. Stored: a reference to ``x``; recomputed from it.
- **projections of the encoder's output** (the keys and values of every decoder layer's
  cross-attention, ``[B*K, L, d]`` each): the attention saves them (PyTorch's fused SDPA saves
  its inputs as they are). Stored: the encoder's output, by its own recipe when it is a norm's
  output (else a reference: the projections' backward keeps it anyway); the backward
  recomputes the projection (``module.forward``: one matmul per tensor, for BART-base about
  2.5% of the step's matmul work). Only plain ``nn.Linear`` layers whose input is the tensor
  :func:`share_input` names (``RagModel`` names the encoder's output) are treated so.
- **dropout masks on the CPU**: torch's CPU dropout saves its scaled mask as a float tensor of
  the activation's size (values ``0`` and ``1 / (1 - p)``); stored as one bit per element and
  the scale. Any saved constant tensor whose values are exactly ``0`` and one positive number
  qualifies; the check is exact, so a tensor that does not match is saved as it was. (One byte
  per element where the C++ extension is missing.)

The recomputation runs the very module (``module.forward``) on the very input, so values and
gradients are bit-identical to a run without this module (``tests/test_lean_activations.py``
checks every gradient with ``torch.equal``). The cost is a few elementwise passes and the
cross-attention projections again in the backward (its measured time: docs/design.md, "Lean
activations"). The memory saved is the size of those tensors: for a BART-base-sized generator, 45% of the
step's activations (docs/design.md, "Lean activations").

A tensor is stored by recipe only when it is provably what the recipe gives back: it is the
module's output itself (or a view of it), unmodified since (its version counter is unchanged),
and the input it is recomputed from is alive and unmodified when the backward needs it (else a
``RuntimeError`` names the module). Inside another ``saved_tensors_hooks`` context (e.g.
``torch.autograd.graph.save_on_cpu``) and under ``torch.compile`` nothing is changed.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import weakref

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from rag_fast import _ext
from rag_fast.ops import masks

# Activation modules whose output is recomputed: elementwise functions whose backward keeps the
# input. ReLU, sigmoid and tanh keep their output instead, so a recipe would save nothing.
_ACTIVATION_NAMES = ("GELUActivation", "NewGELUActivation", "FastGELUActivation",
                     "QuickGELUActivation", "GELUTanh", "PytorchGELUTanh", "AccurateGELUActivation",
                     "ClippedGELUActivation", "SiLUActivation", "MishActivation",
                     "LaplaceActivation")
_NORM_NAME_SUFFIXES = ("RMSNorm", "T5LayerNorm")
# Saved constant tensors smaller than this are left alone (the check would cost more than the
# memory it saves).
MIN_MASK_ELEMENTS = 4096

_state = threading.local()


@functools.lru_cache(maxsize=None)
def _activation_classes() -> tuple[type, ...]:
    classes = [nn.GELU, nn.SiLU, nn.Mish]
    try:
        from transformers import activations
    except ImportError:  # pragma: no cover - transformers is a dependency
        activations = None
    for name in _ACTIVATION_NAMES:
        cls = getattr(activations, name, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            classes.append(cls)
    return tuple(classes)


def recomputable(module: nn.Module) -> bool:
    """Whether :func:`prepare` registers ``module`` (an activation or normalisation module whose
    output is recomputed from its input)."""
    if isinstance(module, _activation_classes()):
        return not getattr(module, "inplace", False)
    if isinstance(module, (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))):
        return True
    return type(module).__name__.endswith(_NORM_NAME_SUFFIXES) and hasattr(module, "weight")


def prepare(model: nn.Module) -> int:
    """Register the forward hook that records recomputable outputs on every module of ``model``
    for which :func:`recomputable` holds (once per module); returns how many modules have it.
    The hook does nothing outside :func:`lean_activations`."""
    count = 0
    for module in model.modules():
        if not recomputable(module):
            continue
        if not getattr(module, "_rag_fast_lean", False):
            # first of the module's hooks: a later hook that changes the output in place fails
            # the version check, one that replaces it leaves the recorded output unused
            module.register_forward_hook(_record_output, prepend=True)
            module._rag_fast_lean = True
        count += 1
    # the linear layers that may take a gated product or project a shared input
    for module in model.modules():
        if isinstance(module, nn.Linear) and not getattr(module, "_rag_fast_lean", False):
            module.register_forward_pre_hook(_record_product)
            module.register_forward_hook(_record_projection, prepend=True)
            module._rag_fast_lean = True
    return count


def _record_output(module: nn.Module, args: tuple, output, projection: bool = False) -> None:
    """Forward hook: remember ``output`` as ``module.forward(args[0])`` (``projection``: a
    linear layer's output from a shared input, see :func:`_record_projection`)."""
    if torch.compiler.is_compiling():
        return
    registry = getattr(_state, "registry", None)
    if registry is None or not isinstance(output, torch.Tensor) or len(args) != 1:
        return
    if nn.modules.module._global_forward_hooks:  # they run before ours and may change it
        return
    (x,) = args
    if not isinstance(x, torch.Tensor) or not output.requires_grad:
        return
    registry.record(module, x, output, projection)


def _record_projection(module: nn.Module, args: tuple, output) -> None:
    """Forward hook of a linear layer: remember ``output`` as ``module.forward(args[0])`` if
    ``args[0]`` is a tensor :func:`share_input` named. Only a plain ``nn.Linear`` (a subclass
    or a parametrised one may keep state that a second forward would change)."""
    if torch.compiler.is_compiling() or type(module) is not nn.Linear:
        return
    registry = getattr(_state, "registry", None)
    if registry is None or not registry.shared or len(args) != 1:
        return
    x = args[0]
    if isinstance(x, torch.Tensor) and registry.is_shared(x):
        _record_output(module, args, output, projection=True)


def share_input(t: torch.Tensor) -> None:
    """Within :func:`lean_activations`: the outputs of linear layers that take ``t`` (as it is
    now, not modified in place since) are stored by recipe, recomputed from ``t`` in the
    backward. Meant for a tensor that stays alive until the backward anyway and that several
    linear layers project (an encoder's output, which every decoder layer's cross-attention
    projects to keys and values). Outside the context, or for a tensor that does not own its
    storage, nothing happens. If ``t`` is itself stored by recipe (a norm's output), the
    projections take it from that recipe and do not keep it alive."""
    if torch.compiler.is_compiling():
        return
    registry = getattr(_state, "registry", None)
    if registry is not None and _plain(t) and _owns_storage(t):
        registry.shared[t.untyped_storage().data_ptr()] = (weakref.ref(t), t._version)


def _record_product(module: nn.Module, args: tuple) -> None:
    """Forward pre-hook of a linear layer: remember its input if it is ``act(u) * v`` with
    ``act(u)`` a recorded activation output."""
    if torch.compiler.is_compiling():
        return
    registry = getattr(_state, "registry", None)
    if registry is None or len(args) != 1 or not isinstance(args[0], torch.Tensor):
        return
    p = args[0]
    node = p.grad_fn
    if node is None or type(node).__name__ != "MulBackward0":
        return
    # Only while this registry packs what is saved: inside another hook context (a
    # checkpointed layer's) reading the product's saved factors would run that context's
    # unpack, e.g. recompute the layer during the forward.
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None or getattr(top[0], "__self__", None) is not registry:
        return
    registry.record_product(p, node)


def _autocast_state(device_type: str) -> tuple:
    """What autocast does now on ``device_type``, for :func:`_autocast`."""
    try:
        return (device_type, torch.is_autocast_enabled(device_type),
                torch.get_autocast_dtype(device_type))
    except (RuntimeError, ValueError):  # a device without autocast
        return (device_type, False, None)


def _autocast(state: tuple):
    """A context that sets autocast as ``state`` recorded it (the forward pass's setting, also
    when the backward runs inside or outside another autocast context)."""
    device_type, enabled, dtype = state
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, enabled=enabled)


class _Source:
    """A recorded output, recomputed on demand: ``module.forward(x)`` under the forward pass's
    autocast setting, or (``act`` given) the product ``act() * other`` / ``other * act()``.

    Every saved view of it shares this object; the value recomputed for the first of them is
    kept until the last has taken it (``pending``), so that, e.g., a norm output saved by the
    three projections of an attention block is recomputed once.
    """

    __slots__ = ("module", "x", "x_version", "x_saved", "autocast", "size", "stride", "act",
                 "act_first", "pending", "cached")

    def __init__(self, module, x, autocast, size, stride, act=None, act_first=True,
                 x_saved=None):
        # x_saved: the input itself stored by recipe (a _Saved), instead of a reference to x
        self.x_saved = x_saved
        self.module, self.x = module, (x if x_saved is None else None)
        self.x_version = x._version
        self.autocast, self.size, self.stride = autocast, size, stride
        self.act, self.act_first = act, act_first
        self.pending, self.cached = 0, None

    def _compute(self) -> torch.Tensor:
        if self.x_saved is not None:  # checks that the input was not modified since
            with torch.no_grad(), _autocast(self.autocast):
                out = self.module.forward(self.x_saved())
            return out.as_strided(self.size, self.stride, 0)
        if self.x._version != self.x_version:
            what = (f"the input of {type(self.module).__name__}" if self.act is None else
                    f"a factor of the product after {type(self.act.module).__name__}")
            raise RuntimeError(
                f"rag_fast lean activations: {what} was modified in place after the forward "
                "pass, so a tensor saved for the backward cannot be recomputed; build the model "
                "with lean_activations=False")
        if self.act is not None:
            a = self.act.take()
            with torch.no_grad():
                return torch.mul(a, self.x) if self.act_first else torch.mul(self.x, a)
        with torch.no_grad(), _autocast(self.autocast):
            out = self.module.forward(self.x)
        return out.as_strided(self.size, self.stride, 0)

    def take(self) -> torch.Tensor:
        out = self.cached if self.cached is not None else self._compute()
        self.pending -= 1
        self.cached = out if self.pending > 0 else None
        return out


class _Saved:
    """What is saved instead of a view of a :class:`_Source`'s output. If the saved tensor is
    still alive and was modified in place since, the backward fails as autograd's own check
    would make it fail."""

    __slots__ = ("source", "size", "stride", "offset", "tensor", "version")

    def __init__(self, source, t):
        self.source, self.size, self.stride = source, t.size(), t.stride()
        self.offset = t.storage_offset()
        self.tensor, self.version = weakref.ref(t), t._version
        source.pending += 1

    def __call__(self) -> torch.Tensor:
        t = self.tensor()
        if t is not None and t._version != self.version:
            self.source.pending -= 1
            _Kept.modified(t, self.version)
        return self.source.take().as_strided(self.size, self.stride, self.offset)


class _Mask:
    """A tensor whose elements all have the bits of ``0.0`` or of one positive value: one bit
    per element (``bits``, unpacked by the C++ extension), or one byte per element (``nonzero``,
    a bool tensor) where the extension is missing."""

    __slots__ = ("bits", "nonzero", "scale", "zero", "one", "like")

    def __init__(self, scale, zero, *, nonzero=None, bits=None, one=0, like=None):
        self.bits, self.nonzero, self.scale, self.zero = bits, nonzero, scale, zero
        # with bits: the positive value's bits, and a zero-stride view of one element that has
        # the mask's shape and dtype
        self.one, self.like = one, like

    @property
    def nbytes(self) -> int:
        """The bytes stored."""
        return (self.bits if self.bits is not None else self.nonzero).numel()

    def __call__(self) -> torch.Tensor:
        if self.bits is not None:
            return masks.bits_unmask(self.bits, self.like, self.one)
        return torch.where(self.nonzero, self.scale, self.zero)


class _Kept:
    """A saved tensor kept as it is. Autograd checks that a saved tensor was not modified in
    place before the backward only for tensors it stores itself, not for what a hook returns:
    the check is repeated here, with autograd's words."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor):
        self.tensor, self.version = tensor, tensor._version

    def __call__(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            self.modified(self.tensor, self.version)
        return self.tensor

    @staticmethod
    def modified(t: torch.Tensor, version: int):
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: a tensor of shape {list(t.shape)} is at version {t._version}; "
            f"expected version {version} instead (rag_fast lean activations: it was saved for "
            "the backward and changed since)")


class _Entry:
    """A recorded output: weak references to it and its input, and its recomputation once a
    saved tensor needs it (``source``)."""

    __slots__ = ("out", "storage", "version", "dtype", "module", "x", "x_version", "autocast",
                 "size", "stride", "source", "stale", "projection")

    def __init__(self, module, x, output):
        self.out, self.version, self.dtype = weakref.ref(output), output._version, output.dtype
        # the output's storage, for when the output itself is gone but views of it live on (a
        # projection reshaped into attention heads): while this weak reference lives, no other
        # storage can take its place
        self.storage = StorageWeakRef(output.untyped_storage())
        self.module, self.x, self.x_version = module, weakref.ref(x), x._version
        self.autocast = _autocast_state(x.device.type)
        self.size, self.stride = output.size(), output.stride()
        self.source = None
        self.stale = False  # the output was seen modified: never recompute it
        self.projection = False  # a linear layer's output from a shared input

    def get_source(self, registry: "_Registry") -> _Source | None:
        """The recomputation, if the input is alive and as it was when the module ran; a
        projection's input that is itself stored by recipe is taken from that recipe."""
        if self.source is None:
            x = self.x()
            if self.stale or x is None or x._version != self.x_version:
                return None
            upstream = registry._source(x) if self.projection else None
            self.source = _Source(self.module, x, self.autocast, self.size, self.stride,
                                  x_saved=None if upstream is None else _Saved(upstream, x))
        return self.source

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies on the recorded output's storage (the output or a view of it,
        also once the output object itself is gone)."""
        return not self.storage.expired() and self.storage.cdata == t.untyped_storage()._cdata

    def unmodified(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (on the output's storage) and the output, if alive, are at the version
        recorded (a view shares its base's version counter)."""
        out = self.out()
        return t._version == self.version and (out is None or out._version == self.version)


class _Registry:
    """The outputs recorded in one :func:`lean_activations` context, by storage address."""

    def __init__(self) -> None:
        self._outputs: dict[int, _Entry] = {}
        # id(grad_fn of a recorded output) -> (grad_fn, entry); the grad_fn is kept (until the
        # context ends) so that its Python object, and with it id(), stays the one a later
        # product's next_functions return
        self._by_node: dict[int, tuple] = {}
        self._products: dict[int, tuple] = {}  # address -> (product, version, source)
        self._counted: set[int] = set()  # sources whose bytes are in bytes_saved
        # storage address -> (tensor, version): inputs whose projections are recomputed
        self.shared: dict[int, tuple] = {}
        # what was stored by recipe, and the bytes those tensors would have taken
        self.recipes = self.masks = self.bytes_saved = 0

    def record(self, module, x, output, projection: bool = False) -> None:
        if not (_plain(output) and _plain(x) and _owns_storage(output)):
            return
        entry = _Entry(module, x, output)
        entry.projection = projection
        self._outputs[output.untyped_storage().data_ptr()] = entry
        if output.grad_fn is not None:
            self._by_node[id(output.grad_fn)] = (output.grad_fn, entry)

    def is_shared(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is a tensor :func:`share_input` named, unmodified since."""
        found = self.shared.get(x.untyped_storage().data_ptr())
        if found is None:
            return False
        t = found[0]()
        return (t is not None and x is t and x._version == found[1])

    def record_product(self, p: torch.Tensor, node) -> None:
        if not (_plain(p) and _owns_storage(p)):
            return
        operands = [operand for operand, _ in node.next_functions[:2]]
        if len(operands) != 2 or any(operand is None for operand in operands):
            return  # a factor without gradient (a dropout mask): nothing to gain
        for side, operand in enumerate(operands):
            found = self._by_node.get(id(operand))
            if found is None or found[0] is not operand:
                continue
            entry = found[1]
            # The product's backward saved the factor through pack, which checked it against
            # the recorded output's version and made its recomputation (entry.source); a factor
            # modified in place before the product made the entry stale there instead. The
            # factor itself may be gone by now.
            if entry.stale or entry.source is None:
                return
            # the other factor, as the product's backward saved it, if pack kept it as it was:
            # read only then (reading a factor stored otherwise would recompute it now)
            other_node = operands[1 - side]
            if id(other_node) in self._by_node:
                return
            other = node._saved_other if side == 0 else node._saved_self
            if not isinstance(other, torch.Tensor) or other.dtype != p.dtype:
                return
            source = _Source(entry.module, other, None, p.size(), p.stride(), act=entry.source,
                             act_first=side == 0)
            self._products[p.untyped_storage().data_ptr()] = (weakref.ref(p), p._version,
                                                              source)
            return

    def close(self) -> None:
        """Forget the recorded outputs (the counters stay)."""
        self._outputs.clear()
        self._by_node.clear()
        self._products.clear()
        self._counted.clear()
        self.shared.clear()

    def _source(self, t: torch.Tensor) -> _Source | None:
        """The recomputation of ``t``'s storage, if ``t`` is a recorded output (or a view of
        it) unmodified since it was recorded."""
        ptr = t.untyped_storage().data_ptr()
        entry = self._outputs.get(ptr)
        if entry is not None and entry.holds(t):
            if not entry.unmodified(t):
                entry.stale = True
            elif t.dtype == entry.dtype:
                return entry.get_source(self)
        product = self._products.get(ptr)
        if product is not None:
            p_ref, version, source = product
            p = p_ref()
            if (p is not None and t.dtype == p.dtype and t._version == version
                    and p._version == version and p.untyped_storage().data_ptr() == ptr):
                if source.pending == 0 and source.cached is None:
                    source.act.pending += 1  # its recomputation takes the factor once
                return source
        return None

    def pack(self, t: torch.Tensor):
        if not _plain(t):
            return _Kept(t)
        source = self._source(t)
        if source is not None:
            self.recipes += 1
            if id(source) not in self._counted:
                self._counted.add(id(source))
                self.bytes_saved += t.untyped_storage().nbytes()
            return _Saved(source, t)
        if (t.device.type == "cpu" and t.grad_fn is None and not t.requires_grad
                and t.dtype in _BITS and t.numel() >= MIN_MASK_ELEMENTS
                and t.is_contiguous() and not t._is_view() and not isinstance(t, nn.Parameter)):
            mask = _as_mask(t)
            if mask is not None:
                self.masks += 1
                self.bytes_saved += t.numel() * t.element_size() - mask.nbytes
                return mask
        return _Kept(t)

    @staticmethod
    def unpack(packed):
        return packed()


def _plain(t: torch.Tensor) -> bool:
    """A dense tensor with real memory of its own: not a tensor subclass (wrapper subclasses
    such as DTensor have no storage of their own), not nested, not on the meta device (whose
    storages all share address 0)."""
    return (type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided
            and not t.is_nested and t.device.type != "meta")


def _owns_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is contiguous and spans its whole storage from its start."""
    storage = t.untyped_storage()
    return (storage.nbytes() > 0 and t.storage_offset() == 0 and t.is_contiguous()
            and storage.nbytes() == t.numel() * t.element_size())


# the integer type of each floating type's bits
_BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
         torch.float16: torch.int16}


def _as_mask(t: torch.Tensor) -> _Mask | None:
    """``t`` as a :class:`_Mask` if the bits of every element are those of ``+0.0`` or of one
    positive finite value (compared as integers: exact, ``-0.0`` and NaN excluded). One pass in
    the C++ extension (``rag_fast.ops.masks.bits_mask``); torch ops without it."""
    head = t.reshape(-1)[:256]
    scale = head.amax()  # the positive value, if the first elements hold it
    if not bool(torch.isfinite(scale)) or not bool(scale > 0):
        return None
    bits = t.view(_BITS[t.dtype]).reshape(-1)
    scale_bits = scale.view(bits.dtype)
    if not bool(((bits[:256] == 0) | (bits[:256] == scale_bits)).all()):
        return None  # most tensors that are no mask fail here, cheaply
    zero = torch.zeros((), dtype=t.dtype)
    if _ext.available():
        one = int(scale_bits) & ((1 << (8 * t.element_size())) - 1)  # the bits, unsigned
        bits = masks.bits_mask(t, one)
        if bits is None:
            return None
        # the shape and dtype to give back, without memory (a zero-stride view of one element)
        like = zero.expand(t.shape)
        return _Mask(scale, zero, bits=bits, one=one, like=like)
    nonzero = bits == scale_bits
    if int(nonzero.sum()) + int((bits == 0).sum()) != bits.numel():
        return None
    return _Mask(scale, zero, nonzero=nonzero.view(t.shape))


@contextlib.contextmanager
def lean_activations(enabled: bool = True):
    """While active, tensors saved for the backward are stored by recipe where the module
    docstring allows it; yields the registry (its ``recipes``, ``masks`` and ``bytes_saved``
    count what was stored that way), or None when nothing is changed: ``enabled`` False,
    gradients off, under ``torch.compile`` or a ``torch.func`` transform, inside another
    ``saved_tensors_hooks`` context, or already active. Only modules :func:`prepare`
    registered are recomputed."""
    if (not enabled or not torch.is_grad_enabled() or torch.compiler.is_compiling()
            or not torch._C._autograd._saved_tensors_hooks_is_enabled()  # torch.func
            or getattr(_state, "registry", None) is not None
            or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None):
        yield None
        return
    registry = _Registry()
    _state.registry = registry
    try:
        with torch.autograd.graph.saved_tensors_hooks(registry.pack, registry.unpack):
            yield registry
    finally:
        _state.registry = None
        registry.close()
