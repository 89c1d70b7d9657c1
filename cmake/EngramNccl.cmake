# NCCL comes from the nvidia-nccl-cu13 (or -cu12) wheel of the Python env, or from NCCL_ROOT when given.
# Never from system directories: the GPU image has a system libnccl 2.28.3 beside the wheel's 2.28.9, and the
# device API is version-locked. The wheel ships only libnccl.so.2, so NAMES_PER_DIR + the SONAME name.
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
    "import importlib.util as u; s = u.find_spec('nvidia.nccl'); print(list(s.submodule_search_locations)[0] if s else '')"
  OUTPUT_VARIABLE _nccl_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
set(_nccl_hints "")
if(DEFINED ENV{NCCL_ROOT})
  list(APPEND _nccl_hints "$ENV{NCCL_ROOT}")
endif()
if(NCCL_ROOT)
  list(APPEND _nccl_hints "${NCCL_ROOT}")
endif()
if(_nccl_wheel)
  list(APPEND _nccl_hints "${_nccl_wheel}")
endif()
unset(NCCL_INCLUDE_DIR CACHE)
unset(NCCL_LIBRARY CACHE)
set(NCCL_FOUND FALSE)
if(_nccl_hints)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include NO_DEFAULT_PATH)
  find_library(NCCL_LIBRARY NAMES libnccl.so.2 nccl NAMES_PER_DIR HINTS ${_nccl_hints}
               PATH_SUFFIXES lib lib64 NO_DEFAULT_PATH)
endif()
if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _code REGEX "#define NCCL_VERSION_CODE")
  string(REGEX MATCH "[0-9]+" NCCL_VERSION_CODE "${_code}")
  get_filename_component(NCCL_LIBRARY_DIR "${NCCL_LIBRARY}" DIRECTORY)
  set(NCCL_FOUND TRUE)
  add_library(Engram::nccl SHARED IMPORTED)
  set_target_properties(Engram::nccl PROPERTIES IMPORTED_LOCATION "${NCCL_LIBRARY}"
                        IMPORTED_SONAME "libnccl.so.2" INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
  message(STATUS "jax_engram: NCCL ${NCCL_VERSION_CODE} headers ${NCCL_INCLUDE_DIR}, library ${NCCL_LIBRARY}")
else()
  message(STATUS "jax_engram: no NCCL wheel (nvidia-nccl-cu13/-cu12) or NCCL_ROOT found")
endif()
