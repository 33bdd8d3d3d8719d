# Build facts of the compiled core: whether OpenMP is compiled in and how many
# threads its parallel regions would use. Values come from build_info.h.

cdef extern from "build_info.h":
    const int PKV_OPENMP                             # 1 if compiled with OpenMP, else 0
    const int PKV_OPENMP_VERSION                     # _OPENMP (yyyymm), 0 without OpenMP
    int pkv_openmp_max_threads() noexcept nogil      # omp_get_max_threads(), 1 without OpenMP
