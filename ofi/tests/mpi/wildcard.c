/* Wildcard receives.
 * Phase 1: every other rank sends rank 0 several messages with distinct tags (1..PER_RANK,
 * in reverse order, lengths by tag) and one message with tag 999; rank 0 receives all of
 * them with MPI_ANY_SOURCE and MPI_ANY_TAG and checks each one's source, tag, count and
 * contents, and that every message arrives exactly once.
 * Phase 2 (after a barrier): every other rank sends tag 1 then tag 2; rank 0 first receives
 * the tag-2 messages with MPI_ANY_SOURCE (overtaking the tag-1 ones), then one message
 * from each rank with MPI_ANY_TAG, which must be its tag-1 message. */
#include "check.h"
#include <string.h>

#define PER_RANK 8
#define MAX_RANKS 1024

static void fill(int *buf, int n, int src, int tag)
{
    for (int i = 0; i < n; i++)
        buf[i] = src * 100000 + tag * 100 + i;
}

int main(int argc, char **argv)
{
    int rank, size;
    MPI_OK(MPI_Init(&argc, &argv));
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    CHECK(size >= 2 && size <= MAX_RANKS, "needs 2..%d ranks, got %d", MAX_RANKS, size);
    int buf[64], want[64];
    if (rank == 0) {
        static int seen[MAX_RANKS][PER_RANK + 1];
        for (int k = 0; k < (size - 1) * (PER_RANK + 1); k++) {
            MPI_Status st;
            int n;
            MPI_OK(MPI_Recv(buf, 64, MPI_INT, MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &st));
            MPI_Get_count(&st, MPI_INT, &n);
            int src = st.MPI_SOURCE, tag = st.MPI_TAG;
            CHECK(src >= 1 && src < size, "source %d", src);
            if (tag == 999) {
                CHECK(n == 1 && buf[0] == src * 7, "tag 999 from %d: count %d value %d", src, n,
                      buf[0]);
                tag = 0;
            } else {
                CHECK(tag >= 1 && tag <= PER_RANK, "tag %d from %d", tag, src);
                CHECK(n == tag * 4, "count %d for tag %d", n, tag);
                fill(want, n, src, tag);
                CHECK(memcmp(buf, want, n * sizeof(int)) == 0, "data of tag %d from %d", tag,
                      src);
            }
            CHECK(!seen[src][tag], "duplicate tag %d from %d", st.MPI_TAG, src);
            seen[src][tag] = 1;
        }
    } else {
        for (int tag = PER_RANK; tag >= 1; tag--) {
            fill(buf, tag * 4, rank, tag);
            MPI_OK(MPI_Send(buf, tag * 4, MPI_INT, 0, tag, MPI_COMM_WORLD));
        }
        int v = rank * 7;
        MPI_OK(MPI_Send(&v, 1, MPI_INT, 0, 999, MPI_COMM_WORLD));
    }
    MPI_OK(MPI_Barrier(MPI_COMM_WORLD));
    if (rank == 0) {
        static int got[MAX_RANKS];
        for (int k = 1; k < size; k++) {
            MPI_Status st;
            int v;
            MPI_OK(MPI_Recv(&v, 1, MPI_INT, MPI_ANY_SOURCE, 2, MPI_COMM_WORLD, &st));
            CHECK(st.MPI_TAG == 2 && v == st.MPI_SOURCE * 10 + 2, "value %d from %d", v,
                  st.MPI_SOURCE);
            CHECK(!got[st.MPI_SOURCE], "second tag-2 message from %d", st.MPI_SOURCE);
            got[st.MPI_SOURCE] = 1;
        }
        for (int src = 1; src < size; src++) {
            MPI_Status st;
            int v;
            MPI_OK(MPI_Recv(&v, 1, MPI_INT, src, MPI_ANY_TAG, MPI_COMM_WORLD, &st));
            CHECK(st.MPI_TAG == 1 && st.MPI_SOURCE == src && v == src * 10 + 1,
                  "from %d: tag %d value %d", src, st.MPI_TAG, v);
        }
        printf("wildcard ok: %d ranks, %d messages\n", size, (size - 1) * (PER_RANK + 3));
    } else {
        int v1 = rank * 10 + 1, v2 = rank * 10 + 2;
        MPI_OK(MPI_Send(&v1, 1, MPI_INT, 0, 1, MPI_COMM_WORLD));
        MPI_OK(MPI_Send(&v2, 1, MPI_INT, 0, 2, MPI_COMM_WORLD));
    }
    MPI_OK(MPI_Finalize());
    return 0;
}
