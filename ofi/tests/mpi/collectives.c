/* Barriers and allreduces: each rank checks the sums, maxima and minima of values every
 * rank contributes; a barrier separates rounds whose results depend on the round. */
#include "check.h"

int main(int argc, char **argv)
{
    int rank, size;
    MPI_OK(MPI_Init(&argc, &argv));
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    const int rounds = 5;
    for (int r = 0; r < rounds; r++) {
        MPI_OK(MPI_Barrier(MPI_COMM_WORLD));
        long v[4] = {rank + r, (long)rank * rank, 1, -rank}, s[4];
        MPI_OK(MPI_Allreduce(v, s, 4, MPI_LONG, MPI_SUM, MPI_COMM_WORLD));
        long n = size;
        CHECK(s[0] == n * (n - 1) / 2 + n * r, "round %d: sum %ld", r, s[0]);
        CHECK(s[1] == (n - 1) * n * (2 * n - 1) / 6, "round %d: sum of squares %ld", r, s[1]);
        CHECK(s[2] == n && s[3] == -(n * (n - 1) / 2), "round %d: %ld %ld", r, s[2], s[3]);
        int mx, mn;
        MPI_OK(MPI_Allreduce(&rank, &mx, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
        MPI_OK(MPI_Allreduce(&rank, &mn, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
        CHECK(mx == size - 1 && mn == 0, "round %d: max %d min %d", r, mx, mn);
        double d = 0.5 * (rank + 1), ds;
        MPI_OK(MPI_Allreduce(&d, &ds, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
        CHECK(ds == 0.25 * n * (n + 1), "round %d: double sum %f", r, ds);
    }
    /* A larger allreduce (a vector of 4096 ints). */
    static int big[4096], bigsum[4096];
    for (int i = 0; i < 4096; i++)
        big[i] = i * (rank + 1);
    MPI_OK(MPI_Allreduce(big, bigsum, 4096, MPI_INT, MPI_SUM, MPI_COMM_WORLD));
    for (int i = 0; i < 4096; i++)
        CHECK(bigsum[i] == i * size * (size + 1) / 2, "element %d: %d", i, bigsum[i]);
    MPI_OK(MPI_Barrier(MPI_COMM_WORLD));
    if (rank == 0)
        printf("collectives ok: %d ranks, %d rounds of barrier+allreduce, 4096-int allreduce\n",
               size, rounds);
    MPI_OK(MPI_Finalize());
    return 0;
}
