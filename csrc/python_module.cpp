// Importing kvpress_cpp._C loads this shared object, which runs the static TORCH_LIBRARY registrations. The module
// itself is empty: every operator is reached through torch.ops.kvcomp.
#include <Python.h>

extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
