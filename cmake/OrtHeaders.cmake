# Locates ONNX Runtime's C/C++ headers and sets ORT_INCLUDE_DIR.
# ORT's pip wheels ship no headers, so by default fetch_ort_headers.sh downloads Debian's
# libonnxruntime-dev (API 21) into the build tree once and this uses only its include dir.
# Override with -DORT_INCLUDE_DIR=... or the ORT_INCLUDE_DIR environment variable.
if(NOT ORT_INCLUDE_DIR AND DEFINED ENV{ORT_INCLUDE_DIR})
  set(ORT_INCLUDE_DIR $ENV{ORT_INCLUDE_DIR})
endif()
if(NOT ORT_INCLUDE_DIR)
  set(_ort_cache ${CMAKE_BINARY_DIR}/ort_headers)
  execute_process(
    COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/fetch_ort_headers.sh ${_ort_cache}
    OUTPUT_VARIABLE _ort_inc OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _ort_rc)
  if(NOT _ort_rc EQUAL 0)
    message(FATAL_ERROR "Could not fetch ONNX Runtime headers (libonnxruntime-dev). "
                        "Set ORT_INCLUDE_DIR to a directory holding onnxruntime_c_api.h.")
  endif()
  set(ORT_INCLUDE_DIR ${_ort_inc})
endif()
if(NOT EXISTS ${ORT_INCLUDE_DIR}/onnxruntime_c_api.h)
  message(FATAL_ERROR "ORT_INCLUDE_DIR=${ORT_INCLUDE_DIR} has no onnxruntime_c_api.h")
endif()
message(STATUS "ort_lora: ONNX Runtime headers from ${ORT_INCLUDE_DIR}")
