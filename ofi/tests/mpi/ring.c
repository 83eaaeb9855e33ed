/* A token goes around the ring of ranks several times; every rank adds its rank and
 * checks the value it receives, the source and the tag. */
#include "check.h"

int main(int argc, char **argv)
{
    int rank, size;
    MPI_OK(MPI_Init(&argc, &argv));
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    CHECK(size >= 2, "needs 2 ranks, got %d", size);
    const int laps = 10;
    int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    long token = 0;
    long per_lap = (long)size * (size - 1) / 2;
    for (int lap = 0; lap < laps; lap++) {
        MPI_Status st;
        if (rank == 0) {
            MPI_OK(MPI_Send(&token, 1, MPI_LONG, next, 100 + lap, MPI_COMM_WORLD));
            MPI_OK(MPI_Recv(&token, 1, MPI_LONG, prev, 100 + lap, MPI_COMM_WORLD, &st));
            CHECK(token == per_lap * (lap + 1), "lap %d: token %ld, want %ld", lap, token,
                  per_lap * (lap + 1));
        } else {
            MPI_OK(MPI_Recv(&token, 1, MPI_LONG, prev, 100 + lap, MPI_COMM_WORLD, &st));
            long want = per_lap * lap + (long)rank * (rank - 1) / 2;
            CHECK(token == want, "lap %d: token %ld, want %ld", lap, token, want);
            token += rank;
            MPI_OK(MPI_Send(&token, 1, MPI_LONG, next, 100 + lap, MPI_COMM_WORLD));
        }
        CHECK(st.MPI_SOURCE == prev && st.MPI_TAG == 100 + lap, "lap %d: source %d tag %d",
              lap, st.MPI_SOURCE, st.MPI_TAG);
    }
    if (rank == 0)
        printf("ring ok: %d ranks, %d laps, token %ld\n", size, laps, token);
    MPI_OK(MPI_Finalize());
    return 0;
}
