// swapkit's saved-tensor hooks in C++: the keep path of swapkit.runtime.step.Step.save and of the session's
// unpack, for the saves that need nothing else (Note [The native save path] in swapkit.runtime.native).
//
// A Saver stands for one SwapSession. Its pack and unpack are C functions bound to it, installed as the
// session's saved-tensor hooks. Each save or unpack that is not a plain keep goes to the session's own
// Python hooks (``slow_pack``, ``slow_unpack``), unchanged; a plain keep does here what the Python does, on
// the same objects: the step's clock, stats and device-bytes ledger, the same Saved handle and KeptRecord, and
// the step's storage indexes, its own and the one of the records made here (Note [The records kept in C++]).
// Neither path knows which one made a handle or a record.
#include <torch/extension.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include <unordered_map>
#include <vector>

namespace {

// Interned attribute names, read once per call where needed.
struct Names {
  PyObject *step, *backward_started, *scheduled, *last_frame, *current, *observer, *clock, *watch_unpacks,
      *saved_bytes, *prefetch, *entries, *index, *param_storages, *stats, *bytes_changed,
      *recomputable, *device, *kept_natively, *schedule, *runtime, *min_offload_bytes, *tail_ticks, *released,
      *storage, *version;
};
Names names;

// Note [The records kept in C++]
// A step's storage index (``Step._index``) maps a storage's key to a weak reference to its record: a key and a
// weak reference per record, made at the save and freed when the step closes, about a tenth of what a keep
// costs here. So the records the C++ makes are indexed apart, in a KeptIndex (``Step.kept_natively``, given to
// the step by the session): a map from the storage's ``StorageImpl`` to the record, borrowed, which each record
// erases when it dies (unindex), as a weak reference would go dead; only a record's own entry is erased.
// Both paths look up both indexes, and the newest record of a storage is in one of them only, as the Python
// session's one index holds the last record made: the C++ makes a record only where neither has a live one,
// and the Python, making one (where its lookup found none, or one of another version), takes the storage's
// entry out of the KeptIndex (``forget``). A record the C++ found first would otherwise be served again where
// the Python's newer one replaced it: two tensors of one storage can have version counters of their own
// (``.data``, ``set_``), so a version an older record holds comes back (test_native_save.py).
struct KeptIndex {
  PyObject_HEAD
  std::unordered_map<const void*, PyObject*> records;  // StorageImpl -> its NativeKeptRecord, borrowed
};

PyTypeObject KeptIndexType = {PyVarObject_HEAD_INIT(nullptr, 0) "swapkit_native_save.KeptIndex"};

inline KeptIndex* as_index(PyObject* object) {
  return Py_TYPE(object) == &KeptIndexType ? reinterpret_cast<KeptIndex*>(object) : nullptr;
}

// The record of ``storage`` in ``records`` (borrowed), or null. A record whose last reference went but whose
// deallocation CPython postponed (the trashcan of deeply nested frees) is still in the map with no reference
// until its finalizer erases it: it counts as gone, never held again.
inline PyObject* live_record(const std::unordered_map<const void*, PyObject*>& records, const void* storage) {
  auto found = records.find(storage);
  return found == records.end() || Py_REFCNT(found->second) == 0 ? nullptr : found->second;
}

PyObject* KeptIndex_new(PyTypeObject* type, PyObject*, PyObject*) {
  PyObject* self = type->tp_alloc(type, 0);
  if (self != nullptr) new (&reinterpret_cast<KeptIndex*>(self)->records) std::unordered_map<const void*, PyObject*>();
  return self;
}

void KeptIndex_dealloc(PyObject* self) {
  using Map = std::unordered_map<const void*, PyObject*>;
  reinterpret_cast<KeptIndex*>(self)->records.~Map();
  Py_TYPE(self)->tp_free(self);
}

// ``get(key)``: the live record of the storage with ``storage_key`` ``key``, or None.
PyObject* KeptIndex_get(PyObject* self, PyObject* key) {
  const void* storage = PyLong_AsVoidPtr(key);
  if (storage == nullptr && PyErr_Occurred()) return nullptr;
  PyObject* record = live_record(reinterpret_cast<KeptIndex*>(self)->records, storage);
  if (record == nullptr) record = Py_None;
  Py_INCREF(record);
  return record;
}

// ``records()``: a list of the live records (new references).
PyObject* KeptIndex_records(PyObject* self, PyObject*) {
  std::vector<PyObject*> live;
  for (auto& entry : reinterpret_cast<KeptIndex*>(self)->records) {
    if (Py_REFCNT(entry.second) == 0) continue;  // its deallocation postponed (live_record)
    Py_INCREF(entry.second);  // held before any allocation below can let a record die and erase itself
    live.push_back(entry.second);
  }
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(live.size()));
  for (size_t i = 0; i < live.size(); i++) {
    if (list != nullptr)
      PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), live[i]);
    else
      Py_DECREF(live[i]);
  }
  return list;
}

// ``forget(key)``: the storage with ``storage_key`` ``key`` has a newer record in the step's own index. Its
// record here, if any, lives on (its handles hold it) unindexed: its fifth item, the index, becomes None, so it
// looks for no entry when it dies (unindex).
PyObject* KeptIndex_forget(PyObject* self, PyObject* key) {
  const void* storage = PyLong_AsVoidPtr(key);
  if (storage == nullptr && PyErr_Occurred()) return nullptr;
  auto& records = reinterpret_cast<KeptIndex*>(self)->records;
  auto found = records.find(storage);
  if (found == records.end()) Py_RETURN_NONE;
  PyObject* record = found->second;
  records.erase(found);
  if (PyList_GET_SIZE(record) >= 5) {
    Py_INCREF(Py_None);
    PyList_SetItem(record, 4, Py_None);  // drops the record's reference to this index, which the caller holds
  }
  Py_RETURN_NONE;
}

PyObject* KeptIndex_clear(PyObject* self, PyObject*) {
  reinterpret_cast<KeptIndex*>(self)->records.clear();  // no Python runs: the entries are borrowed
  Py_RETURN_NONE;
}

PyMethodDef kept_index_methods[] = {
    {"get", KeptIndex_get, METH_O, "the live record of the storage with this storage_key, or None"},
    {"records", KeptIndex_records, METH_NOARGS, "the live records"},
    {"forget", KeptIndex_forget, METH_O, "drop the entry of the storage with this storage_key (a newer record)"},
    {"clear", KeptIndex_clear, METH_NOARGS, "forget every record (the step closed)"},
    {nullptr, nullptr, 0, nullptr}};

struct Saver {
  PyObject_HEAD
  PyObject* session;  // the SwapSession (its _step, observer)
  PyObject* tracker;  // its ScopeTracker (current)
  PyObject* session_dict;  // their instance dicts (Note [Attributes read from the instance dict])
  PyObject* tracker_dict;
  PyObject* slow_pack;  // the session's Python hooks
  PyObject* slow_unpack;
  PyObject* settle;  // Step.settle, kept out of Dynamo as the Python hooks are (swapkit.runtime.dynamo)
  PyObject* advance;  // SwapSchedule.advance, the same
  PyObject* swap_add;  // SwapSchedule.add, Step.unpacked, SwapRecord.restore: Note [Swaps served in C++]
  PyObject* step_unpacked;
  PyObject* restore;
  PyTypeObject* swap_type;  // swapkit.runtime.records.SwapRecord
  PyTypeObject* saved_type;  // swapkit.runtime.records.Saved
  PyTypeObject* kept_type;  // swapkit.runtime.native.NativeKeptRecord: made here; its base, KeptRecord, by the Python
  PyTypeObject* step_type;  // swapkit.runtime.step.Step: a subclass (a micro-step) saves its own way
  // What the cached step holds, read once per step (refresh): the step itself is compared by identity.
  PyObject* step;
  PyObject* step_dict;  // its instance dict (Note [Attributes read from the instance dict])
  PyObject* index;  // step._index: storage key -> weakref to its record
  PyObject* params;  // step.param_storages
  PyObject* stats;  // step.stats
  PyObject* stats_dict;  // its instance dict
  PyObject* changed;  // step.bytes_changed
  PyObject* recomputables;  // step._recomputable.entries, a dict (RecomputableOutputs never replaces it)
  PyObject* kept_index;  // step.kept_natively, a KeptIndex (Note [The records kept in C++])
  PyObject* schedule;  // step.schedule, a SwapSchedule
  int device_type, device_index;  // step.device
  int64_t min_offload;  // step.runtime.min_offload_bytes
  int64_t tail;  // step.tail_ticks, or -1 where it is None
  int64_t settle_mask;
  int64_t packs, unpacks;  // saves and unpacks served here, not by the Python hooks
  int64_t swap_packs, swap_unpacks;  // of those, the swapped ones (Note [Swaps served in C++])
};

PyTypeObject SaverType = {PyVarObject_HEAD_INIT(nullptr, 0) "swapkit_native_save.Saver"};

// The object ``ref`` refers to, as a new reference in ``out`` (null once it died): 1, 0 (dead) or -1 (error).
// PyWeakref_GetObject, deprecated since Python 3.13, before PyWeakref_GetRef existed.
inline int referent(PyObject* ref, PyObject** out) {
#if PY_VERSION_HEX >= 0x030D0000
  return PyWeakref_GetRef(ref, out);
#else
  PyObject* object = PyWeakref_GetObject(ref);  // borrowed; None once dead
  *out = nullptr;
  if (object == nullptr) return -1;
  if (object == Py_None) return 0;
  Py_INCREF(object);
  *out = object;
  return 1;
#endif
}

// A kept record, made here or by the Python (exactly those types: a swap record is neither).
inline bool kept(Saver* saver, PyObject* record) {
  PyTypeObject* type = Py_TYPE(record);
  return type == saver->kept_type || type == saver->kept_type->tp_base;
}

// A new reference to attribute ``name`` of ``object``, or null with the error set.
inline PyObject* attr(PyObject* object, PyObject* name) { return PyObject_GetAttr(object, name); }

// Note [Attributes read from the instance dict]
// A save reads about ten attributes of the session, its scope tracker, the step and its stats, each a plain
// instance attribute. ``PyObject_GetAttr`` looks the name up on the type first (for a descriptor), then in
// the instance dict; the C++ reads the dict itself, kept once per object (``instance_dict``), which is
// what ``getattr`` finds there whenever the type has no data descriptor of that name: a property or slot
// would win over the dict, so an object whose type has one for any name read this way gets no dict here
// and every read goes through ``PyObject_GetAttr``. A name missing from the dict (a class attribute) is
// read the same way. Writes (the clock, ``saved_bytes``) go to the same dict, as ``setattr`` does. The dict is
// the one the object had when the session (its tracker) was hooked or the step first saved here: nothing in
// swapkit assigns a new ``__dict__`` to any of them, and one assigned would not be seen (a step's clock would
// stop moving for the Python).

// A new reference to ``object.__dict__`` where the names of ``names`` can be read from it (none is a data
// descriptor of its type); null otherwise, or with the error set.
PyObject* instance_dict(PyObject* object, std::initializer_list<PyObject*> names) {
  for (PyObject* name : names) {
    PyObject* found = _PyType_Lookup(Py_TYPE(object), name);  // borrowed
    if (found != nullptr && Py_TYPE(found)->tp_descr_set != nullptr) return nullptr;
  }
  if (_PyObject_GetDictPtr(object) == nullptr) return nullptr;
  PyObject* dict = PyObject_GenericGetDict(object, nullptr);
  if (dict != nullptr && !PyDict_CheckExact(dict)) Py_CLEAR(dict);
  return dict;
}

// A new reference to ``object.name``, read from ``dict`` (its instance_dict, or null); null with the error set.
inline PyObject* read(PyObject* object, PyObject* dict, PyObject* name) {
  if (dict != nullptr) {
    PyObject* value = PyDict_GetItemWithError(dict, name);  // borrowed
    if (value != nullptr) {
      Py_INCREF(value);
      return value;
    }
    if (PyErr_Occurred()) return nullptr;
  }
  return PyObject_GetAttr(object, name);
}

// ``object.name = value``, written to ``dict`` (its instance_dict, or null): -1 with the error set.
inline int write(PyObject* object, PyObject* dict, PyObject* name, PyObject* value) {
  return dict != nullptr ? PyDict_SetItem(dict, name, value) : PyObject_SetAttr(object, name, value);
}

// ``object.name`` identical to ``expected`` (compared by identity: the object holds it): 1, 0 or -1 (error).
inline int is(PyObject* object, PyObject* dict, PyObject* name, PyObject* expected) {
  PyObject* value = read(object, dict, name);
  if (value == nullptr) return -1;
  Py_DECREF(value);
  return value == expected;
}

// 1: the attribute is true, 0: false, -1: error.
inline int truth(PyObject* object, PyObject* dict, PyObject* name) {
  PyObject* value = read(object, dict, name);
  if (value == nullptr) return -1;
  int result = PyObject_IsTrue(value);
  Py_DECREF(value);
  return result;
}

void clear_step(Saver* saver) {
  Py_CLEAR(saver->step);
  Py_CLEAR(saver->step_dict);
  Py_CLEAR(saver->index);
  Py_CLEAR(saver->params);
  Py_CLEAR(saver->stats);
  Py_CLEAR(saver->stats_dict);
  Py_CLEAR(saver->changed);
  Py_CLEAR(saver->recomputables);
  Py_CLEAR(saver->kept_index);
  Py_CLEAR(saver->schedule);
}

// An integer attribute of ``object`` in ``*out``, -1 where it is None: false with the error set.
bool read_int(PyObject* object, PyObject* name, int64_t* out) {
  THPObjectPtr value(attr(object, name));
  if (!value) return false;
  *out = value.get() == Py_None ? -1 : PyLong_AsLongLong(value.get());
  return !(*out == -1 && PyErr_Occurred());
}

// What a swap served here reads of ``step`` (Note [Swaps served in C++]): its schedule, the runtime's
// min_offload_bytes and the tail the step does not offload. Each is set when the step is made and never again.
// False with the error set.
bool swap_settings(Saver* saver, PyObject* step) {
  saver->schedule = attr(step, names.schedule);
  THPObjectPtr runtime(saver->schedule ? attr(step, names.runtime) : nullptr);
  return runtime && read_int(runtime.get(), names.min_offload_bytes, &saver->min_offload) &&
         read_int(step, names.tail_ticks, &saver->tail);
}

// Read what a fast save needs of ``step`` once; false with the error set.
bool refresh(Saver* saver, PyObject* step) {
  clear_step(saver);
  PyObject* device = attr(step, names.device);
  if (device == nullptr) return false;
  if (!THPDevice_Check(device)) {
    Py_DECREF(device);
    PyErr_SetString(PyExc_TypeError, "swapkit native save: step.device is not a torch.device");
    return false;
  }
  const at::Device& value = reinterpret_cast<THPDevice*>(device)->device;
  saver->device_type = static_cast<int>(value.type());
  saver->device_index = value.index();
  Py_DECREF(device);
  saver->index = attr(step, names.index);
  saver->params = saver->index ? attr(step, names.param_storages) : nullptr;
  saver->stats = saver->params ? attr(step, names.stats) : nullptr;
  saver->changed = saver->stats ? attr(step, names.bytes_changed) : nullptr;
  THPObjectPtr recomputable(saver->changed ? attr(step, names.recomputable) : nullptr);
  saver->recomputables = recomputable ? attr(recomputable.get(), names.entries) : nullptr;
  saver->kept_index = saver->recomputables ? attr(step, names.kept_natively) : nullptr;
  if (saver->kept_index != nullptr && as_index(saver->kept_index) == nullptr) {
    PyErr_SetString(PyExc_TypeError, "swapkit native save: step.kept_natively is no KeptIndex (session._start_step)");
    clear_step(saver);
    return false;
  }
  if (saver->kept_index != nullptr && !swap_settings(saver, step)) {
    clear_step(saver);
    return false;
  }
  if (saver->kept_index != nullptr) {  // Note [Attributes read from the instance dict]
    saver->step_dict = instance_dict(step, {names.backward_started, names.last_frame, names.clock, names.scheduled,
                                            names.watch_unpacks});
    saver->stats_dict = PyErr_Occurred() ? nullptr : instance_dict(saver->stats, {names.saved_bytes});
  }
  if (saver->kept_index == nullptr || PyErr_Occurred() || !PyDict_CheckExact(saver->index) ||
      !PyAnySet_Check(saver->params) || !PyDict_Check(saver->recomputables)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "swapkit native save: the step's index is no dict");
    clear_step(saver);
    return false;
  }
  Py_INCREF(step);
  saver->step = step;
  return true;
}

// The step's clock, as Step.save moves it: the tick of this save, the clock moved past it and, once a swap
// record was queued in the step, ``step.schedule.advance(tick)`` (the releases due by now). The tick is the
// clock's own value object (a new reference: the handle holds it) and ``*value``; null with the error set. The
// step is the saver's (refresh), which read its schedule once (swap_settings).
PyObject* tick(Saver* saver, PyObject* step, int64_t* value) {
  THPObjectPtr clock(read(step, saver->step_dict, names.clock));
  if (!clock) return nullptr;
  *value = PyLong_AsLongLong(clock.get());
  if (*value == -1 && PyErr_Occurred()) return nullptr;
  THPObjectPtr next(PyLong_FromLongLong(*value + 1));
  if (!next || write(step, saver->step_dict, names.clock, next.get()) < 0) return nullptr;
  int scheduled = truth(step, saver->step_dict, names.scheduled);
  if (scheduled < 0) return nullptr;
  if (scheduled > 0) {
    THPObjectPtr done(PyObject_CallFunctionObjArgs(saver->advance, saver->schedule, clock.get(), nullptr));
    if (!done) return nullptr;
  }
  return clock.release();
}

// A Saved handle (keeper, version, step, tick, record, meta, frame): the Python make_saved, without its call;
// ``meta`` is None for a kept storage. Steals ``keeper`` and ``at``; null with the error set.
PyObject* saved(Saver* saver, PyObject* keeper, PyObject* version, PyObject* step, PyObject* at, PyObject* record,
                PyObject* frame, PyObject* meta = Py_None) {
  PyObject* handle = saver->saved_type->tp_alloc(saver->saved_type, 7);
  if (handle == nullptr) {
    Py_DECREF(at);
    Py_DECREF(keeper);
    return nullptr;
  }
  PyObject* items[7] = {keeper, version, step, at, record, meta, frame};
  for (int i : {1, 2, 4, 5, 6}) Py_INCREF(items[i]);
  for (int i = 0; i < 7; i++) PyTuple_SET_ITEM(handle, i, items[i]);
  PyObject_GC_UnTrack(handle);  // Note [Objects the collector need not see] in swapkit.runtime.native
  return handle;
}

// ``stats.saved_bytes += nbytes``; false with the error set.
bool count_saved(Saver* saver, PyObject* nbytes) {
  THPObjectPtr before(read(saver->stats, saver->stats_dict, names.saved_bytes));
  THPObjectPtr after(before ? PyNumber_Add(before.get(), nbytes) : nullptr);
  return after && write(saver->stats, saver->stats_dict, names.saved_bytes, after.get()) == 0;
}

// ``changed(nbytes)`` (the step's ledger) and, every SETTLE_TICKS ticks, ``step.settle()``.
bool account(Saver* saver, PyObject* step, PyObject* nbytes, int64_t at) {
  PyObject* result = PyObject_CallOneArg(saver->changed, nbytes);
  if (result == nullptr) return false;
  Py_DECREF(result);
  if (at & saver->settle_mask) return true;
  result = PyObject_CallOneArg(saver->settle, step);
  Py_XDECREF(result);
  return result != nullptr;
}

// 1: the save is a plain keep this path can serve; 0: the Python hooks serve it; -1: error. Every test
// Step.save and SwapSession._pack make before a keep: not in backward, the session's step running its
// forward, the frame the previous save had, no observer. None has a side effect, and the releases that
// tick() runs first where a swap was queued change none of their answers (nor those of the index,
// parameter and recomputable lookups), so the order of Step.save is kept. The step is the saver's (refresh).
int fast_state(Saver* saver, PyObject* step, PyObject* frame) {
  int test = truth(step, saver->step_dict, names.backward_started);
  if (test != 0) return test < 0 ? -1 : 0;
  test = is(step, saver->step_dict, names.last_frame, frame);
  if (test != 1) return test;
  return is(saver->session, saver->session_dict, names.observer, Py_None);
}

// What Step._first_save does with a storage the step has no live record of, where the C++ can do the same.
enum FirstSave { kPython = 0, kKeepRecord = 1, kKeepBare = 2, kSwap = 3 };

// A plain ``torch.Tensor``, not a view, with no attributes: no parameter unless the step knows its storage as
// one (the Python's parameter test, Step._first_save).
inline bool bare_tensor(PyObject* object, const at::Tensor& tensor) {
  if (Py_TYPE(object) != reinterpret_cast<PyTypeObject*>(THPVariableClass) || tensor.is_view()) return false;
  PyObject** dict = _PyObject_GetDictPtr(object);
  return dict == nullptr || *dict == nullptr || PyDict_GET_SIZE(*dict) == 0;
}

// A storage with bytes on the step's device.
inline bool on_device(Saver* saver, const at::Tensor& tensor) {
  const at::Device device = tensor.device();
  return tensor.storage().nbytes() > 0 && static_cast<int>(device.type()) == saver->device_type &&
         device.index() == saver->device_index;
}

// In a swap scope of distance ``prefetch``: kSwap where Step._first_save would start a swap and nothing else
// (Note [Swaps served in C++]), kPython where it might keep the storage and count why, or it is a recomputable
// output. The save's tick is the step's clock (tick() moves it after). -1: error.
int swap_candidate(Saver* saver, PyObject* object, const at::Tensor& tensor, PyObject* key, PyObject* step,
                   int64_t prefetch) {
  int parameter = PySet_Contains(saver->params, key);
  if (parameter != 0) return parameter < 0 ? -1 : kPython;
  if (!bare_tensor(object, tensor) || !on_device(saver, tensor) || PyDict_GET_SIZE(saver->recomputables) > 0)
    return kPython;
  const at::ScalarType dtype = tensor.scalar_type();
  if (dtype == at::kHalf || dtype == at::kBFloat16) return kPython;  // autocast's cache may hold it (autocast.py)
  if (static_cast<int64_t>(tensor.storage().nbytes()) < saver->min_offload) return kPython;  // small
  if (saver->tail >= 0) {  // swap_schedule Note [The last k ticks stay on the device]
    THPObjectPtr clock(read(step, saver->step_dict, names.clock));
    const int64_t now = clock ? PyLong_AsLongLong(clock.get()) : -1;
    if (now == -1 && PyErr_Occurred()) return -1;
    if (now < saver->tail && saver->tail <= now + prefetch) return kPython;
  }
  return kSwap;
}

// kKeepRecord: kept with a new KeptRecord; kKeepBare: kept without a record, outside a swap scope (a
// parameter's storage, an empty one, one on another device: _not_candidate does nothing there); kSwap: a new
// swap record (swap_candidate); kPython: the Python decides (a possible parameter, a recomputable output, a swap
// candidate it keeps). -1: error.
int first_save(Saver* saver, PyObject* object, const at::Tensor& tensor, PyObject* key, PyObject* step,
               PyObject* frame) {
  if (frame != Py_None) {
    THPObjectPtr prefetch(attr(frame, names.prefetch));
    if (!prefetch) return -1;
    if (prefetch.get() != Py_None) {
      const int64_t distance = PyLong_AsLongLong(prefetch.get());
      if (distance == -1 && PyErr_Occurred()) return -1;
      return swap_candidate(saver, object, tensor, key, step, distance);
    }
  }
  int parameter = PySet_Contains(saver->params, key);
  if (parameter != 0) return parameter < 0 ? -1 : kKeepBare;
  if (!bare_tensor(object, tensor)) return kPython;
  if (!on_device(saver, tensor)) return kKeepBare;
  return PyDict_GET_SIZE(saver->recomputables) > 0 ? kPython : kKeepRecord;
}

// A save of a storage whose KeptRecord ``record`` the step has (the same version), or (``record`` None) one
// kept without a record: a handle of it.
PyObject* keep_again(Saver* saver, const at::Tensor& tensor, PyObject* version, PyObject* step, PyObject* record,
                     PyObject* frame) {
  int64_t value;
  PyObject* at = tick(saver, step, &value);
  if (at == nullptr) return nullptr;
  PyObject* keeper = THPVariable_Wrap(tensor.detach());
  if (keeper == nullptr) {
    Py_DECREF(at);
    return nullptr;  // saved() steals a keeper: never a null one
  }
  return saved(saver, keeper, version, step, at, record, frame);
}

// ``NativeKeptRecord((step, nbytes, version, keeper, index))`` without the call: KeptRecord is a list subclass
// with no ``__init__`` of its own, so an empty instance filled with the items is what the call makes; the
// fifth, the KeptIndex it is in, is where it erases itself when it dies. A new reference, or null with the
// error set.
PyObject* kept_record(PyTypeObject* type, PyObject* step, PyObject* nbytes, PyObject* version, PyObject* keeper,
                      PyObject* index) {
  PyObject** storage = PyMem_New(PyObject*, 5);
  PyObject* record = storage ? type->tp_alloc(type, 0) : nullptr;
  if (record == nullptr) {
    PyMem_Free(storage);
    return PyErr_Occurred() ? nullptr : PyErr_NoMemory();
  }
  PyObject* items[5] = {step, nbytes, version, keeper, index};
  for (int i = 0; i < 5; i++) {
    Py_INCREF(items[i]);
    storage[i] = items[i];
  }
  auto* list = reinterpret_cast<PyListObject*>(record);
  list->ob_item = storage;
  list->allocated = 5;
  Py_SET_SIZE(list, 5);
  PyObject_GC_UnTrack(record);  // Note [Objects the collector need not see] in swapkit.runtime.native
  return record;
}

// A new storage kept: Step._first_save's keep, on the same objects but its index (Note [The records kept in
// C++]).
PyObject* keep_new(Saver* saver, const at::Tensor& tensor, PyObject* version, PyObject* step, PyObject* frame) {
  int64_t value;
  THPObjectPtr at(tick(saver, step, &value));
  if (!at) return nullptr;
  THPObjectPtr nbytes(PyLong_FromLongLong(static_cast<int64_t>(tensor.storage().nbytes())));
  THPObjectPtr keeper(nbytes ? THPVariable_Wrap(tensor.detach()) : nullptr);  // Note [Version keepers] in records
  if (!keeper || !count_saved(saver, nbytes.get()) || !account(saver, step, nbytes.get(), value)) return nullptr;
  THPObjectPtr record(kept_record(saver->kept_type, step, nbytes.get(), version, keeper.get(), saver->kept_index));
  if (!record) return nullptr;
  // Indexed first: a record that dies here (no handle made) erases its entry as any other does.
  as_index(saver->kept_index)->records[tensor.storage().unsafeGetStorageImpl()] = record.get();
  return saved(saver, keeper.release(), version, step, at.release(), record.get(), frame);  // it holds the record
}

// A tuple of ``values`` as Python integers, untracked (it holds none of the collector's objects).
PyObject* int_tuple(c10::IntArrayRef values) {
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(values.size()));
  for (size_t i = 0; tuple != nullptr && i < values.size(); i++) {
    PyObject* value = PyLong_FromLongLong(values[i]);
    if (value == nullptr) Py_CLEAR(tuple);
    else PyTuple_SET_ITEM(tuple, static_cast<Py_ssize_t>(i), value);
  }
  if (tuple != nullptr && PyObject_GC_IsTracked(tuple)) PyObject_GC_UnTrack(tuple);
  return tuple;
}

// swapkit.runtime.records.view_meta: ``(dtype, size, stride, storage_offset, is_conj, is_neg)``, untracked as
// the Python's becomes at the collector's first look. A new reference, or null with the error set.
PyObject* view_meta(const at::Tensor& tensor) {
  THPObjectPtr size(int_tuple(tensor.sizes()));
  THPObjectPtr stride(size ? int_tuple(tensor.strides()) : nullptr);
  THPObjectPtr offset(stride ? PyLong_FromLongLong(tensor.storage_offset()) : nullptr);
  if (!offset) return nullptr;
  PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(tensor.scalar_type()));  // borrowed
  PyObject* meta = PyTuple_Pack(6, dtype, size.get(), stride.get(), offset.get(),
                                tensor.is_conj() ? Py_True : Py_False, tensor.is_neg() ? Py_True : Py_False);
  if (meta != nullptr && PyObject_GC_IsTracked(meta)) PyObject_GC_UnTrack(meta);
  return meta;
}

// Note [Swaps served in C++]
// A new storage that Step._first_save would swap and do nothing else with (swap_candidate: no parameter, view,
// attribute, recomputable output, autocast dtype, small storage or tail) is served here up to the record itself:
// the clock, the keeper, ``SwapSchedule.add`` (called: the batch, the release queue and the stats are the
// schedule's), ``step._scheduled``, the step's index, the stats and the ledger in the Python's order, and the
// handle with its view metadata. An unpack of a handle with a SwapRecord, with no observer and a Step (not a
// micro-step), is session._unpack without its frame: the version check (a mismatch goes to the Python, which
// raises the session's error), ``Step.unpacked`` while the step watches unpacks, then the keeper or, once the
// record was released, ``SwapRecord.restore``. A storage saved again, a re-save of a swapped storage included,
// goes to the Python as before. A swap record found by the storage's key whose storage died (another took its
// StorageImpl's address) or was written since is stale (stale_swap): the save is a first save, and the record
// leaves the step's index, as the Python's first save replaces it there; a storage then kept here is indexed
// in the KeptIndex only, which a later Python save reads after the step's index. The handle is untracked like a kept one (Note [Objects the collector need not
// see] in swapkit.runtime.native): its view metadata holds only integers, a dtype and booleans, and its
// record is a SwapRecord, which refers to no handle.
PyObject* swap_new(Saver* saver, const at::Tensor& tensor, PyObject* version, PyObject* step, PyObject* key,
                   PyObject* frame) {
  int64_t value;
  THPObjectPtr at(tick(saver, step, &value));
  if (!at) return nullptr;
  THPObjectPtr nbytes(PyLong_FromLongLong(static_cast<int64_t>(tensor.storage().nbytes())));
  THPObjectPtr keeper(nbytes ? THPVariable_Wrap(tensor.detach()) : nullptr);  // Note [Version keepers] in records
  THPObjectPtr storage(keeper ? THPStorage_Wrap(tensor.storage()) : nullptr);
  if (!storage) return nullptr;
  THPObjectPtr record(PyObject_CallFunctionObjArgs(saver->swap_add, saver->schedule, storage.get(), nbytes.get(),
                                                   version, frame, at.get(), keeper.get(), nullptr));
  if (!record || write(step, saver->step_dict, names.scheduled, Py_True) < 0 ||
      !count_saved(saver, nbytes.get()) || !account(saver, step, nbytes.get(), value))
    return nullptr;
  THPObjectPtr ref(PyWeakref_NewRef(record.get(), nullptr));  // Note [The cost of a save] in swapkit.runtime.step
  if (!ref || PyDict_SetItem(saver->index, key, ref.get()) < 0) return nullptr;
  THPObjectPtr meta(view_meta(tensor));
  if (!meta) return nullptr;
  saver->swap_packs++;
  return saved(saver, keeper.release(), version, step, at.release(), record.get(), frame, meta.get());
}

// keep_new, swap_new or, ``record`` None, keep_again for a storage kept without a record, with a new version
// object.
PyObject* keep_first(Saver* saver, const at::Tensor& tensor, int64_t version, PyObject* step, int first,
                     PyObject* key, PyObject* frame) {
  THPObjectPtr number(PyLong_FromLongLong(version));
  if (!number) return nullptr;
  if (first == kSwap) return swap_new(saver, tensor, number.get(), step, key, frame);
  return first == kKeepRecord ? keep_new(saver, tensor, number.get(), step, frame)
                              : keep_again(saver, tensor, number.get(), step, Py_None, frame);
}

// 1: ``record``, a SwapRecord found by the key of ``storage`` (a StorageImpl), is not this storage's at this
// version: its storage died and another took its StorageImpl's address (the record holds it weakly), or the
// storage was written since; Step.save makes a new record. 0: it is; -1: error.
int stale_swap(PyObject* record, const void* storage, int64_t version) {
  THPObjectPtr ref(attr(record, names.storage));
  PyObject* held = nullptr;
  int alive = ref ? referent(ref.get(), &held) : -1;
  if (alive <= 0) return alive < 0 ? -1 : 1;
  const bool same = THPStorage_Check(held) && THPStorage_Unpack(held).unsafeGetStorageImpl() == storage;
  Py_DECREF(held);  // Step.save's ``record.storage() is storage``, by the StorageImpl
  if (!same) return 1;
  THPObjectPtr was(attr(record, names.version));
  const int64_t saved = was ? PyLong_AsLongLong(was.get()) : -1;
  if (saved == -1 && PyErr_Occurred()) return -1;
  return saved != version;
}

// The fast save, or null with no error set when the Python hooks must serve it.
PyObject* fast_pack(Saver* saver, PyObject* object, PyObject* step, PyObject* frame) {
  const at::Tensor& tensor = THPVariable_Unpack(object);
  if (!tensor.has_storage() || tensor.layout() != c10::kStrided || tensor.is_nested() || tensor.is_quantized() ||
      Py_TYPE(step) != saver->step_type)  // a subclass (a micro-step) saves its own way
    return nullptr;
  if (step != saver->step && !refresh(saver, step)) return nullptr;
  if (fast_state(saver, step, frame) <= 0) return nullptr;
  // Objects below are owned, so that a C++ error (a dispatch mode refusing a keeper's detach) drops them on its
  // way to HANDLE_TH_ERRORS. A version object is made only for a save served here: a re-save uses its record's.
  const int64_t version = static_cast<int64_t>(tensor._version());
  // Its record: in the C++'s index, else in the step's (Note [The records kept in C++]).
  const void* storage = tensor.storage().unsafeGetStorageImpl();
  auto& natively = as_index(saver->kept_index)->records;
  PyObject* found = live_record(natively, storage);
  Py_XINCREF(found);
  // the step's index is keyed by swapkit.runtime.records.storage_key
  THPObjectPtr key(found ? nullptr : PyLong_FromVoidPtr(const_cast<void*>(storage)));
  if (!found && !key) return nullptr;
  PyObject* ref = key ? PyDict_GetItemWithError(saver->index, key.get()) : nullptr;  // borrowed
  if (ref != nullptr && referent(ref, &found) < 0) return nullptr;
  THPObjectPtr record(found);  // owned: alive for the call (the wrap may run the collector)
  if (record && Py_TYPE(record.get()) == saver->swap_type) {
    int stale = stale_swap(record.get(), storage, version);
    if (stale < 0) return nullptr;
    if (stale) {  // Step.save's first save, which replaces the index entry: a kept record here goes to the
      // KeptIndex, and the stale one left in the step's index would be found first by a later Python save
      if (key && PyDict_DelItem(saver->index, key.get()) < 0) return nullptr;  // swap records: the step's index
      record = nullptr;
    }
  }
  PyObject* result = nullptr;
  if (record) {
    if (kept(saver, record.get()) && PyList_GET_SIZE(record.get()) >= 4) {
      PyObject* kept_version = PyList_GET_ITEM(record.get(), 2);
      int64_t was = PyLong_AsLongLong(kept_version);
      if (was == -1 && PyErr_Occurred()) return nullptr;
      if (was == version) result = keep_again(saver, tensor, kept_version, step, record.get(), frame);
    }
  } else if (!PyErr_Occurred()) {  // a new storage, or a dead record's key reused: Step.save's first save
    int first = first_save(saver, object, tensor, key.get(), step, frame);
    if (first < 0) return nullptr;
    if (first != kPython) result = keep_first(saver, tensor, version, step, first, key.get(), frame);
  }
  return result;
}

PyObject* pack(PyObject* self, PyObject* object) {
  HANDLE_TH_ERRORS
  auto* saver = reinterpret_cast<Saver*>(self);
  if (torch::autograd::get_current_graph_task_id() == -1 && THPVariable_CheckExact(object)) {
    THPObjectPtr step(read(saver->session, saver->session_dict, names.step));  // owned: dropped by a C++ error too
    THPObjectPtr frame(step ? read(saver->tracker, saver->tracker_dict, names.current) : nullptr);
    PyObject* result = frame ? fast_pack(saver, object, step.get(), frame.get()) : nullptr;
    if (result != nullptr) {
      saver->packs++;
      return result;
    }
    if (PyErr_Occurred()) return nullptr;
  }
  return PyObject_CallOneArg(saver->slow_pack, object);
  END_HANDLE_TH_ERRORS
}

// 1: ``handle`` is a kept save's whose keeper can be handed back as it is (SwapSession._unpack's tests);
// 0: the Python hook decides; -1: error.
int plain_unpack(Saver* saver, PyObject* handle) {
  if (Py_TYPE(handle) != saver->saved_type || PyTuple_GET_SIZE(handle) != 7) return 0;
  PyObject* keeper = PyTuple_GET_ITEM(handle, 0);
  PyObject* step = PyTuple_GET_ITEM(handle, 2);
  PyObject* record = PyTuple_GET_ITEM(handle, 4);
  if (!THPVariable_Check(keeper) || (record != Py_None && !kept(saver, record))) return 0;
  int64_t version = PyLong_AsLongLong(PyTuple_GET_ITEM(handle, 1));
  if (version == -1 && PyErr_Occurred()) return -1;
  if (static_cast<int64_t>(THPVariable_Unpack(keeper)._version()) != version) return 0;  // the Python raises
  if (step == Py_None) return 1;
  int watched = truth(step, step == saver->step ? saver->step_dict : nullptr, names.watch_unpacks);
  if (watched != 0) return watched < 0 ? -1 : 0;
  return is(saver->session, saver->session_dict, names.observer, Py_None);
}

// The unpack of a swapped save (Note [Swaps served in C++]): a new reference, or null with no error set where
// the Python hook serves it, or with the error set.
PyObject* swap_unpack(Saver* saver, PyObject* handle) {
  if (Py_TYPE(handle) != saver->saved_type || PyTuple_GET_SIZE(handle) != 7) return nullptr;
  PyObject* keeper = PyTuple_GET_ITEM(handle, 0);
  PyObject* step = PyTuple_GET_ITEM(handle, 2);
  PyObject* record = PyTuple_GET_ITEM(handle, 4);
  if (Py_TYPE(record) != saver->swap_type || Py_TYPE(step) != saver->step_type || !THPVariable_Check(keeper))
    return nullptr;
  int64_t version = PyLong_AsLongLong(PyTuple_GET_ITEM(handle, 1));
  if (version == -1 && PyErr_Occurred()) return nullptr;
  if (static_cast<int64_t>(THPVariable_Unpack(keeper)._version()) != version) return nullptr;  // the Python raises
  if (is(saver->session, saver->session_dict, names.observer, Py_None) != 1) return nullptr;
  PyObject* at = PyTuple_GET_ITEM(handle, 3);
  int watched = truth(step, step == saver->step ? saver->step_dict : nullptr, names.watch_unpacks);
  if (watched < 0) return nullptr;
  if (watched > 0) {
    THPObjectPtr done(PyObject_CallFunctionObjArgs(saver->step_unpacked, step, at, record, nullptr));
    if (!done) return nullptr;
  }
  int released = truth(record, nullptr, names.released);
  if (released < 0) return nullptr;
  PyObject* tensor = keeper;
  if (released == 0)
    Py_INCREF(keeper);
  else
    tensor = PyObject_CallFunctionObjArgs(saver->restore, record, PyTuple_GET_ITEM(handle, 5), at, nullptr);
  if (tensor != nullptr) {
    saver->swap_unpacks++;
    saver->unpacks++;
  }
  return tensor;
}

PyObject* unpack(PyObject* self, PyObject* handle) {
  HANDLE_TH_ERRORS
  auto* saver = reinterpret_cast<Saver*>(self);
  int plain = plain_unpack(saver, handle);
  if (plain < 0) return nullptr;
  if (plain == 0) {
    PyObject* swapped = swap_unpack(saver, handle);
    if (swapped != nullptr || PyErr_Occurred()) return swapped;
    return PyObject_CallOneArg(saver->slow_unpack, handle);
  }
  saver->unpacks++;
  PyObject* keeper = PyTuple_GET_ITEM(handle, 0);
  Py_INCREF(keeper);
  return keeper;
  END_HANDLE_TH_ERRORS
}

PyMethodDef pack_def = {"pack", pack, METH_O, "swapkit's pack hook (Note [The native save path])"};
PyMethodDef unpack_def = {"unpack", unpack, METH_O, "swapkit's unpack hook (Note [The native save path])"};

int Saver_traverse(PyObject* self, visitproc visit, void* arg) {
  auto* saver = reinterpret_cast<Saver*>(self);
  Py_VISIT(saver->session);
  Py_VISIT(saver->tracker);
  Py_VISIT(saver->session_dict);
  Py_VISIT(saver->tracker_dict);
  Py_VISIT(saver->slow_pack);
  Py_VISIT(saver->slow_unpack);
  Py_VISIT(saver->settle);
  Py_VISIT(saver->advance);
  Py_VISIT(saver->swap_add);
  Py_VISIT(saver->step_unpacked);
  Py_VISIT(saver->restore);
  Py_VISIT(saver->swap_type);
  Py_VISIT(saver->saved_type);
  Py_VISIT(saver->kept_type);
  Py_VISIT(saver->step_type);
  Py_VISIT(saver->step);
  Py_VISIT(saver->step_dict);
  Py_VISIT(saver->index);
  Py_VISIT(saver->params);
  Py_VISIT(saver->stats);
  Py_VISIT(saver->stats_dict);
  Py_VISIT(saver->changed);
  Py_VISIT(saver->recomputables);
  Py_VISIT(saver->kept_index);
  Py_VISIT(saver->schedule);
  return 0;
}

int Saver_clear(PyObject* self) {
  auto* saver = reinterpret_cast<Saver*>(self);
  Py_CLEAR(saver->session);
  Py_CLEAR(saver->tracker);
  Py_CLEAR(saver->session_dict);
  Py_CLEAR(saver->tracker_dict);
  Py_CLEAR(saver->slow_pack);
  Py_CLEAR(saver->slow_unpack);
  Py_CLEAR(saver->settle);
  Py_CLEAR(saver->advance);
  Py_CLEAR(saver->swap_add);
  Py_CLEAR(saver->step_unpacked);
  Py_CLEAR(saver->restore);
  Py_CLEAR(saver->swap_type);
  Py_CLEAR(saver->saved_type);
  Py_CLEAR(saver->kept_type);
  Py_CLEAR(saver->step_type);
  clear_step(saver);
  return 0;
}

void Saver_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  Saver_clear(self);
  Py_TYPE(self)->tp_free(self);
}

PyObject* Saver_counts(PyObject* self, PyObject*) {
  auto* saver = reinterpret_cast<Saver*>(self);
  return Py_BuildValue("(LL)", static_cast<long long>(saver->packs), static_cast<long long>(saver->unpacks));
}

PyObject* Saver_swap_counts(PyObject* self, PyObject*) {
  auto* saver = reinterpret_cast<Saver*>(self);
  return Py_BuildValue("(LL)", static_cast<long long>(saver->swap_packs), static_cast<long long>(saver->swap_unpacks));
}

PyObject* Saver_forget_step(PyObject* self, PyObject*) {
  clear_step(reinterpret_cast<Saver*>(self));
  Py_RETURN_NONE;
}

PyObject* Saver_kept_index(PyObject*, PyObject*) {
  return KeptIndex_new(&KeptIndexType, nullptr, nullptr);
}

PyObject* Saver_session(PyObject* self, void*) {
  PyObject* session = reinterpret_cast<Saver*>(self)->session;
  if (session == nullptr) Py_RETURN_NONE;
  Py_INCREF(session);
  return session;
}

PyGetSetDef saver_getset[] = {
    {"session", Saver_session, nullptr, "the SwapSession whose hooks these are", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyMethodDef saver_methods[] = {
    {"counts", Saver_counts, METH_NOARGS, "(packs, unpacks) served in C++"},
    {"swap_counts", Saver_swap_counts, METH_NOARGS, "of those, (packs, unpacks) of swapped saves"},
    {"forget_step", Saver_forget_step, METH_NOARGS, "drop the references to the cached step"},
    {"kept_index", Saver_kept_index, METH_NOARGS, "a new step's KeptIndex (Note [The records kept in C++])"},
    {nullptr, nullptr, 0, nullptr}};

PyObject* intern(const char* name) {
  PyObject* value = PyUnicode_InternFromString(name);
  if (value == nullptr) throw py::error_already_set();
  return value;
}

void ready_types() {
  if (SaverType.tp_flags & Py_TPFLAGS_READY) return;
  names = Names{intern("_step"), intern("backward_started"), intern("_scheduled"), intern("_last_frame"),
                intern("current"), intern("observer"), intern("clock"), intern("watch_unpacks"),
                intern("saved_bytes"), intern("prefetch"), intern("entries"), intern("_index"),
                intern("param_storages"), intern("stats"), intern("bytes_changed"), intern("_recomputable"),
                intern("device"), intern("kept_natively"), intern("schedule"), intern("runtime"),
                intern("min_offload_bytes"), intern("tail_ticks"), intern("released"), intern("storage"),
                intern("version")};
  SaverType.tp_basicsize = sizeof(Saver);
  SaverType.tp_dealloc = Saver_dealloc;
  SaverType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  SaverType.tp_traverse = Saver_traverse;
  SaverType.tp_clear = Saver_clear;
  SaverType.tp_free = PyObject_GC_Del;
  SaverType.tp_methods = saver_methods;
  SaverType.tp_getset = saver_getset;
  if (PyType_Ready(&SaverType) < 0) throw py::error_already_set();
  KeptIndexType.tp_basicsize = sizeof(KeptIndex);
  KeptIndexType.tp_new = KeptIndex_new;
  KeptIndexType.tp_dealloc = KeptIndex_dealloc;
  KeptIndexType.tp_flags = Py_TPFLAGS_DEFAULT;  // holds no reference: nothing for the collector
  KeptIndexType.tp_methods = kept_index_methods;
  KeptIndexType.tp_doc = "the records the C++ made, by storage (Note [The records kept in C++])";
  if (PyType_Ready(&KeptIndexType) < 0) throw py::error_already_set();
}

// The pack and unpack hooks of ``session`` (Note [The native save path]) and the Saver they are bound to.
py::tuple make_hooks(py::object session, py::object tracker, py::object slow_pack, py::object slow_unpack,
                     py::object settle, py::object advance, py::object swap_add, py::object step_unpacked,
                     py::object restore, py::object saved_type, py::object kept_type, py::object swap_type,
                     py::object step_type, int64_t settle_ticks) {
  ready_types();
  if (!PyType_Check(saved_type.ptr()) || !PyType_Check(kept_type.ptr()) || !PyType_Check(step_type.ptr()) ||
      !PyType_Check(swap_type.ptr()) ||
      !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(saved_type.ptr()), &PyTuple_Type) ||
      !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(kept_type.ptr()), &PyList_Type))
    throw py::type_error("swapkit native save: Saved must be a tuple type and KeptRecord a list type");
  auto* kept = reinterpret_cast<PyTypeObject*>(kept_type.ptr());
  if (kept->tp_init != PyList_Type.tp_init || kept->tp_new != PyList_Type.tp_new)
    throw py::type_error("swapkit native save: KeptRecord must not define __new__ or __init__ (kept_record)");
  if (settle_ticks <= 0 || (settle_ticks & (settle_ticks - 1)))
    throw py::value_error("swapkit native save: settle_ticks must be a power of two");
  auto* saver = PyObject_GC_New(Saver, &SaverType);
  if (saver == nullptr) throw py::error_already_set();
  PyObject* held[13] = {session.ptr(), tracker.ptr(), slow_pack.ptr(), slow_unpack.ptr(), saved_type.ptr(),
                        kept_type.ptr(), step_type.ptr(), settle.ptr(), advance.ptr(), swap_add.ptr(),
                        step_unpacked.ptr(), restore.ptr(), swap_type.ptr()};
  for (PyObject* object : held) Py_INCREF(object);
  saver->session = held[0];
  saver->tracker = held[1];
  saver->slow_pack = held[2];
  saver->slow_unpack = held[3];
  saver->saved_type = reinterpret_cast<PyTypeObject*>(held[4]);
  saver->kept_type = reinterpret_cast<PyTypeObject*>(held[5]);
  saver->step_type = reinterpret_cast<PyTypeObject*>(held[6]);
  saver->settle = held[7];
  saver->advance = held[8];
  saver->swap_add = held[9];
  saver->step_unpacked = held[10];
  saver->restore = held[11];
  saver->swap_type = reinterpret_cast<PyTypeObject*>(held[12]);
  saver->step = saver->step_dict = saver->index = saver->params = saver->stats = saver->stats_dict = nullptr;
  saver->changed = saver->recomputables = saver->kept_index = saver->schedule = nullptr;
  saver->min_offload = saver->tail = -1;
  // Note [Attributes read from the instance dict]
  saver->session_dict = instance_dict(saver->session, {names.step, names.observer});
  saver->tracker_dict = PyErr_Occurred() ? nullptr : instance_dict(saver->tracker, {names.current});
  saver->device_type = saver->device_index = 0;
  saver->settle_mask = settle_ticks - 1;
  saver->packs = saver->unpacks = saver->swap_packs = saver->swap_unpacks = 0;
  PyObject_GC_Track(reinterpret_cast<PyObject*>(saver));
  auto owner = py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(saver));
  if (PyErr_Occurred()) throw py::error_already_set();
  auto pack_hook = py::reinterpret_steal<py::object>(PyCFunction_New(&pack_def, owner.ptr()));
  auto unpack_hook = py::reinterpret_steal<py::object>(PyCFunction_New(&unpack_def, owner.ptr()));
  if (!pack_hook || !unpack_hook) throw py::error_already_set();
  return py::make_tuple(pack_hook, unpack_hook, owner);
}

}  // namespace

// Takes ``record`` (a NativeKeptRecord) out of its KeptIndex, if it is in one: its fifth item is the index
// until forget or the record's death. Found by its keeper's storage, or, where that keeper was ``set_()`` to
// another storage since (nothing in swapkit does; an entry left behind would name a dead record), by a walk of
// the index; after the step's close (clear) the index is empty. Runs no Python.
static void unindex(PyObject* record) {
  KeptIndex* index = PyList_GET_SIZE(record) >= 5 ? as_index(PyList_GET_ITEM(record, 4)) : nullptr;
  if (index == nullptr || index->records.empty()) return;
  auto& records = index->records;
  PyObject* keeper = PyList_GET_ITEM(record, 3);
  if (THPVariable_Check(keeper) && THPVariable_Unpack(keeper).has_storage()) {
    auto entry = records.find(THPVariable_Unpack(keeper).storage().unsafeGetStorageImpl());
    if (entry != records.end() && entry->second == record) {
      records.erase(entry);
      return;
    }
  }
  for (auto entry = records.begin(); entry != records.end(); ++entry) {
    if (entry->second == record) {
      records.erase(entry);
      return;
    }
  }
}

// KeptRecord.__del__ (swapkit.runtime.records Note [Record lifetime]) in C, for the records made here:
// ``self[0].bytes_changed(-self[1])`` without a Python frame, and the record's entry in its KeptIndex erased
// (Note [The records kept in C++]).
PyObject* release_kept(PyObject* self, PyObject*) {
  if (!PyList_Check(self) || PyList_GET_SIZE(self) < 2) Py_RETURN_NONE;
  unindex(self);
  PyObject* step = PyList_GET_ITEM(self, 0);
  PyObject* nbytes = PyList_GET_ITEM(self, 1);
  Py_INCREF(step);
  Py_INCREF(nbytes);
  PyObject* changed = PyObject_GetAttr(step, names.bytes_changed);
  PyObject* amount = changed ? PyNumber_Negative(nbytes) : nullptr;
  PyObject* result = amount ? PyObject_CallOneArg(changed, amount) : nullptr;
  Py_XDECREF(amount);
  Py_XDECREF(changed);
  Py_DECREF(nbytes);
  Py_DECREF(step);
  return result;
}

PyMethodDef release_def = {"__del__", release_kept, METH_NOARGS,
                           "KeptRecord.__del__ in C (Note [Record lifetime] in swapkit.runtime.records)"};

// The type's finalizer: release_kept, called directly, not found as ``__del__`` and called as a method
// (CPython's finalizer for a class with ``__del__``). As any finalizer, it keeps the error being raised.
void finalize_kept(PyObject* self) {
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyObject* result = release_kept(self, nullptr);
  if (result == nullptr)
    PyErr_WriteUnraisable(self);
  else
    Py_DECREF(result);
  PyErr_Restore(type, value, traceback);
}

// Gives ``type`` (a KeptRecord subclass with no ``__del__`` of its own) release_kept as its ``__del__`` and its
// finalizer (finalize_kept). Setting ``__del__`` again would bring back CPython's finalizer, which calls it.
void install_finalizer(py::object type) {
  ready_types();
  auto* record_type = reinterpret_cast<PyTypeObject*>(type.ptr());
  if (!PyType_Check(type.ptr()) || !PyType_IsSubtype(record_type, &PyList_Type) ||
      !(record_type->tp_flags & Py_TPFLAGS_HEAPTYPE))
    throw py::type_error("swapkit native save: the record type must be a list type defined in Python");
  THPObjectPtr method(PyDescr_NewMethod(record_type, &release_def));
  if (!method || PyObject_SetAttrString(type.ptr(), "__del__", method.get()) < 0) throw py::error_already_set();
  record_type->tp_finalize = finalize_kept;  // after the assignment above, which set CPython's
}

namespace swapkit {
int64_t copy_region(const at::Tensor& region, py::list sources);  // region_copy.cpp
void bind_record_ops(py::module_& m);  // record_ops.cpp
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("copy_region", &swapkit::copy_region, "a coalesced batch's copy into its host region, without the interpreter lock");
  swapkit::bind_record_ops(m);
  m.def("make_hooks", &make_hooks, "the session's native pack and unpack hooks and their Saver");
  m.def("install_finalizer", &install_finalizer, "KeptRecord.__del__ in C, as the given record type's finalizer");
  ready_types();
  Py_INCREF(&KeptIndexType);
  m.attr("KeptIndex") = py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(&KeptIndexType));
}
