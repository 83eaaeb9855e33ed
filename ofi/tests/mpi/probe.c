/* Probes and cancels. Every other rank sends rank 0 a small and a large (256 KiB) message;
 * rank 0 finds them with MPI_Probe (MPI_ANY_SOURCE, MPI_ANY_TAG), MPI_Iprobe and
 * MPI_Mprobe/MPI_Improbe + MPI_Mrecv, sizes its buffers from the status and checks the
 * data. Then every rank posts a receive nobody sends to and cancels it
 * (MPI_Test_cancelled must say so). */
#include "check.h"
#include <string.h>

#define BIG (256 * 1024)

static unsigned char pat(int src, int tag, size_t i)
{
    return (unsigned char)(src * 7 + tag * 3 + i * 11 + (i >> 8));
}

static void check_data(const unsigned char *b, int n, int src, int tag)
{
    for (int i = 0; i < n; i++)
        CHECK(b[i] == pat(src, tag, i), "byte %d of tag %d from %d", i, tag, src);
}

int main(int argc, char **argv)
{
    int rank, size;
    MPI_OK(MPI_Init(&argc, &argv));
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    CHECK(size >= 2, "needs 2 ranks, got %d", size);
    static unsigned char buf[BIG];
    if (rank == 0) {
        /* Phase 1: MPI_Probe then MPI_Recv of exactly the probed size. */
        for (int k = 0; k < 2 * (size - 1); k++) {
            MPI_Status st;
            int n;
            MPI_OK(MPI_Probe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &st));
            MPI_Get_count(&st, MPI_BYTE, &n);
            CHECK((st.MPI_TAG == 1 && n == 100) || (st.MPI_TAG == 2 && n == BIG),
                  "probed tag %d count %d", st.MPI_TAG, n);
            int src = st.MPI_SOURCE, tag = st.MPI_TAG;
            MPI_OK(MPI_Recv(buf, n, MPI_BYTE, src, tag, MPI_COMM_WORLD, &st));
            CHECK(st.MPI_SOURCE == src && st.MPI_TAG == tag, "received %d/%d", st.MPI_SOURCE,
                  st.MPI_TAG);
            check_data(buf, n, src, tag);
        }
        MPI_OK(MPI_Barrier(MPI_COMM_WORLD));
        /* Phase 2: MPI_Iprobe polling, then matched probes (MPI_Mprobe / MPI_Improbe). */
        for (int k = 0; k < 2 * (size - 1); k++) {
            MPI_Status st;
            MPI_Message msg;
            int flag = 0, n;
            if (k % 2 == 0) {
                while (!flag)
                    MPI_OK(MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &flag, &st));
                flag = 0;
                while (!flag)
                    MPI_OK(MPI_Improbe(st.MPI_SOURCE, st.MPI_TAG, MPI_COMM_WORLD, &flag, &msg,
                                       &st));
            } else {
                MPI_OK(MPI_Mprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &msg, &st));
            }
            MPI_Get_count(&st, MPI_BYTE, &n);
            int src = st.MPI_SOURCE, tag = st.MPI_TAG;
            CHECK((tag == 3 && n == 100) || (tag == 4 && n == BIG), "mprobe tag %d count %d",
                  tag, n);
            memset(buf, 0, n);
            MPI_OK(MPI_Mrecv(buf, n, MPI_BYTE, &msg, &st));
            check_data(buf, n, src, tag);
        }
    } else {
        for (int tag = 1; tag <= 2; tag++) {
            int n = tag == 1 ? 100 : BIG;
            for (int i = 0; i < n; i++)
                buf[i] = pat(rank, tag, i);
            MPI_OK(MPI_Send(buf, n, MPI_BYTE, 0, tag, MPI_COMM_WORLD));
        }
        MPI_OK(MPI_Barrier(MPI_COMM_WORLD));
        for (int tag = 3; tag <= 4; tag++) {
            int n = tag == 3 ? 100 : BIG;
            for (int i = 0; i < n; i++)
                buf[i] = pat(rank, tag, i);
            MPI_OK(MPI_Send(buf, n, MPI_BYTE, 0, tag, MPI_COMM_WORLD));
        }
    }
    /* Phase 3: a receive that nothing matches, cancelled. */
    MPI_Request rq;
    MPI_Status st;
    int cancelled = 0, x;
    MPI_OK(MPI_Irecv(&x, 1, MPI_INT, MPI_ANY_SOURCE, 12345, MPI_COMM_WORLD, &rq));
    MPI_OK(MPI_Cancel(&rq));
    MPI_OK(MPI_Wait(&rq, &st));
    MPI_OK(MPI_Test_cancelled(&st, &cancelled));
    CHECK(cancelled, "the receive was not cancelled");
    MPI_OK(MPI_Barrier(MPI_COMM_WORLD));
    if (rank == 0)
        printf("probe ok: %d ranks, %d messages probed, a receive cancelled\n", size,
               4 * (size - 1));
    MPI_OK(MPI_Finalize());
    return 0;
}
