/* Shared by the MPI test programs: a failed check prints and exits non-zero. */
#ifndef RINGBELL_MPI_CHECK_H
#define RINGBELL_MPI_CHECK_H
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        if (!(cond)) {                                                     \
            int r_;                                                        \
            MPI_Comm_rank(MPI_COMM_WORLD, &r_);                            \
            fprintf(stderr, "rank %d: check failed at %s:%d: %s: ", r_,    \
                    __FILE__, __LINE__, #cond);                            \
            fprintf(stderr, __VA_ARGS__);                                  \
            fprintf(stderr, "\n");                                         \
            fflush(stderr);                                                \
            MPI_Abort(MPI_COMM_WORLD, 3);                                  \
            exit(3);                                                       \
        }                                                                  \
    } while (0)

#define MPI_OK(call)                                                       \
    do {                                                                   \
        int e_ = (call);                                                   \
        CHECK(e_ == MPI_SUCCESS, "%s returned %d", #call, e_);             \
    } while (0)

#endif
