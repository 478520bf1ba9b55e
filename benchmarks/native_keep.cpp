// Way (k) of benchmarks/microbench.py: a keep's bookkeeping in C++ (Note [What a save path in C++ pays]
// in microbench.py). Built on first use by torch.utils.cpp_extension.load; a benchmark, not part of swapkit.
//
// A Hooks object holds one storage index. Its pack hook ticks a clock, tests that the tensor is plain,
// looks its StorageImpl up in the index, and for a storage it has no record of (or one written in place
// since) makes a record: the storage's bytes, counted in the held bytes and their peak, and the parameter
// and device tests of a new storage. Every save gets a handle: a detached keeper, the version it had, its
// record. The unpack hook checks the version (an in-place write raises) and returns the keeper. A record
// lives while a handle holds it; the last handle's end takes its bytes off and its index entry out.
#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>

#include <unordered_map>
#include <unordered_set>

namespace {

struct Hooks;

struct Record {
  Hooks* owner;
  c10::Storage storage;  // the index's key stays this storage while the record lives
  int64_t nbytes;
  int64_t version;
  int64_t handles;
};

struct Hooks {
  PyObject_HEAD
  std::unordered_map<c10::StorageImpl*, Record*>* index;
  std::unordered_set<c10::StorageImpl*>* parameters;  // empty here: the lookup is what a keep pays
  int64_t clock, bytes, peak, records;
};

struct Handle {
  PyObject_HEAD
  PyObject* keeper;
  PyObject* hooks;  // keeps the index alive for the record's release
  int64_t version;
  Record* record;
};

PyTypeObject HooksType = {PyVarObject_HEAD_INIT(nullptr, 0) "native_keep.Hooks"};
PyTypeObject HandleType = {PyVarObject_HEAD_INIT(nullptr, 0) "native_keep.Handle"};

void release(Record* record) {
  if (--record->handles > 0) return;
  Hooks* hooks = record->owner;
  hooks->bytes -= record->nbytes;
  auto found = hooks->index->find(record->storage.unsafeGetStorageImpl());
  if (found != hooks->index->end() && found->second == record) hooks->index->erase(found);
  delete record;
}

void Handle_dealloc(PyObject* self) {
  auto* handle = reinterpret_cast<Handle*>(self);
  Py_XDECREF(handle->keeper);
  if (handle->record != nullptr) release(handle->record);
  Py_XDECREF(handle->hooks);
  Py_TYPE(self)->tp_free(self);
}

PyObject* make_handle(PyObject* hooks, const at::Tensor& tensor, int64_t version, Record* record) {
  PyObject* keeper = THPVariable_Wrap(tensor.detach());
  if (keeper == nullptr) return nullptr;
  auto* handle = PyObject_New(Handle, &HandleType);
  if (handle == nullptr) {
    Py_DECREF(keeper);
    return nullptr;
  }
  Py_INCREF(hooks);
  handle->keeper = keeper;
  handle->hooks = hooks;
  handle->version = version;
  handle->record = record;
  if (record != nullptr) record->handles++;
  return reinterpret_cast<PyObject*>(handle);
}

Record* record_of(Hooks* hooks, const at::Tensor& tensor, int64_t version) {
  c10::StorageImpl* key = tensor.storage().unsafeGetStorageImpl();
  auto found = hooks->index->find(key);
  if (found != hooks->index->end() && found->second->version == version) return found->second;
  bool parameter = hooks->parameters->count(key) > 0 || tensor.is_view();
  bool elsewhere = tensor.device().type() != c10::kCPU;
  (void)parameter;  // the tests a new storage needs; their answers do not matter here
  (void)elsewhere;
  auto* record = new Record{hooks, tensor.storage(), static_cast<int64_t>(key->nbytes()), version, 0};
  (*hooks->index)[key] = record;  // replaces a record written in place since: its handles keep it
  hooks->bytes += record->nbytes;
  hooks->peak = std::max(hooks->peak, hooks->bytes);
  hooks->records++;
  return record;
}

PyObject* pack(PyObject* self, PyObject* object) {
  HANDLE_TH_ERRORS
  auto* hooks = reinterpret_cast<Hooks*>(self);
  hooks->clock++;
  const at::Tensor& tensor = THPVariable_Unpack(object);
  int64_t version = tensor._version();
  bool plain = THPVariable_CheckExact(object) && tensor.layout() == c10::kStrided && !tensor.is_nested() &&
               !tensor.is_quantized();  // (i) also takes an exact nn.Parameter; none is saved in the benchmark
  return make_handle(self, tensor, version, plain ? record_of(hooks, tensor, version) : nullptr);
  END_HANDLE_TH_ERRORS
}

PyObject* unpack(PyObject*, PyObject* object) {
  HANDLE_TH_ERRORS
  if (Py_TYPE(object) != &HandleType) {
    PyErr_SetString(PyExc_TypeError, "native_keep: not a handle of its pack hook");
    return nullptr;
  }
  auto* handle = reinterpret_cast<Handle*>(object);
  if (THPVariable_Unpack(handle->keeper)._version() != handle->version) {
    PyErr_SetString(PyExc_RuntimeError, "native_keep: a saved tensor was modified in place");
    return nullptr;
  }
  Py_INCREF(handle->keeper);
  return handle->keeper;
  END_HANDLE_TH_ERRORS
}

PyMethodDef pack_def = {"pack", pack, METH_O, "the pack hook"};
PyMethodDef unpack_def = {"unpack", unpack, METH_O, "the unpack hook"};

void Hooks_dealloc(PyObject* self) {
  auto* hooks = reinterpret_cast<Hooks*>(self);
  delete hooks->index;  // no record is left: each handle holds this object
  delete hooks->parameters;
  Py_TYPE(self)->tp_free(self);
}

void ready(PyTypeObject* type, Py_ssize_t size, destructor dealloc) {
  if (type->tp_flags & Py_TPFLAGS_READY) return;
  type->tp_basicsize = size;
  type->tp_dealloc = dealloc;
  type->tp_flags = Py_TPFLAGS_DEFAULT;
  if (PyType_Ready(type) < 0) throw py::error_already_set();
}

}  // namespace

// (pack, unpack, counters): the hooks of a new index, and a function reading its counters.
py::tuple make_hooks() {
  ready(&HooksType, sizeof(Hooks), Hooks_dealloc);
  ready(&HandleType, sizeof(Handle), Handle_dealloc);
  auto* hooks = PyObject_New(Hooks, &HooksType);
  if (hooks == nullptr) throw py::error_already_set();
  hooks->index = new std::unordered_map<c10::StorageImpl*, Record*>();
  hooks->parameters = new std::unordered_set<c10::StorageImpl*>();
  hooks->clock = hooks->bytes = hooks->peak = hooks->records = 0;
  auto self = py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(hooks));
  auto pack_fn = py::reinterpret_steal<py::object>(PyCFunction_New(&pack_def, self.ptr()));
  auto unpack_fn = py::reinterpret_steal<py::object>(PyCFunction_New(&unpack_def, self.ptr()));
  py::cpp_function counters([self]() {
    auto* state = reinterpret_cast<Hooks*>(self.ptr());
    return py::dict(py::arg("saves") = state->clock, py::arg("bytes") = state->bytes,
                    py::arg("peak") = state->peak, py::arg("records") = state->records,
                    py::arg("indexed") = state->index->size());
  });
  return py::make_tuple(pack_fn, unpack_fn, counters);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("make_hooks", &make_hooks, "way (k)'s pack and unpack hooks over a new storage index, and its counters");
}
