/* A 1 MiB message (rendezvous) from every rank to the next, with a pattern checked byte by
 * byte; then rank 0 sends a 4 MiB message to the last rank, received into a larger buffer
 * with MPI_ANY_SOURCE (count checked); then a synchronous send (MPI_Ssend). */
#include "check.h"
#include <stdint.h>
#include <string.h>

static unsigned char pattern(int src, size_t i)
{
    return (unsigned char)((i * 31 + (size_t)src * 17 + (i >> 12)) & 0xff);
}

int main(int argc, char **argv)
{
    int rank, size;
    MPI_OK(MPI_Init(&argc, &argv));
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    CHECK(size >= 2, "needs 2 ranks, got %d", size);
    const size_t mib = 1 << 20;
    unsigned char *out = malloc(4 * mib), *in = malloc(5 * mib);
    CHECK(out && in, "out of memory");
    int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    for (size_t i = 0; i < mib; i++)
        out[i] = pattern(rank, i);
    memset(in, 0, mib);
    MPI_Request rq[2];
    MPI_Status st[2];
    MPI_OK(MPI_Irecv(in, (int)mib, MPI_BYTE, prev, 7, MPI_COMM_WORLD, &rq[0]));
    MPI_OK(MPI_Isend(out, (int)mib, MPI_BYTE, next, 7, MPI_COMM_WORLD, &rq[1]));
    MPI_OK(MPI_Waitall(2, rq, st));
    for (size_t i = 0; i < mib; i++)
        CHECK(in[i] == pattern(prev, i), "byte %zu of the 1 MiB message from %d: %u", i, prev,
              in[i]);

    int last = size - 1;
    if (rank == 0) {
        for (size_t i = 0; i < 4 * mib; i++)
            out[i] = pattern(1000, i);
        MPI_OK(MPI_Send(out, (int)(4 * mib), MPI_BYTE, last, 8, MPI_COMM_WORLD));
    } else if (rank == last) {
        int n;
        memset(in, 0, 5 * mib);
        MPI_OK(MPI_Recv(in, (int)(5 * mib), MPI_BYTE, MPI_ANY_SOURCE, 8, MPI_COMM_WORLD, &st[0]));
        MPI_Get_count(&st[0], MPI_BYTE, &n);
        CHECK(n == (int)(4 * mib) && st[0].MPI_SOURCE == 0, "count %d source %d", n,
              st[0].MPI_SOURCE);
        for (size_t i = 0; i < 4 * mib; i++)
            CHECK(in[i] == pattern(1000, i), "byte %zu of the 4 MiB message: %u", i, in[i]);
        CHECK(in[4 * mib] == 0, "wrote past the message");
    }

    int v = rank * 3, w = -1;
    if (rank == 0) {
        MPI_OK(MPI_Ssend(&v, 1, MPI_INT, 1, 9, MPI_COMM_WORLD));
    } else if (rank == 1) {
        MPI_OK(MPI_Recv(&w, 1, MPI_INT, 0, 9, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
        CHECK(w == 0, "ssend value %d", w);
    }
    MPI_OK(MPI_Barrier(MPI_COMM_WORLD));
    if (rank == 0)
        printf("large ok: %d ranks, 1 MiB ring exchange, 4 MiB to rank %d, ssend\n", size, last);
    free(out);
    free(in);
    MPI_OK(MPI_Finalize());
    return 0;
}
