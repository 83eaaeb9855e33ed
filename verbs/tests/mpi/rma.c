/* MPI one-sided communication, checked by every rank: MPI_Put and MPI_Get in fence epochs,
 * MPI_Fetch_and_op under a shared lock (every rank adds its rank + 1 to a word of rank 0's),
 * and MPI_Accumulate; over Open MPI's UCX one-sided component these are RDMA WRITEs, READs
 * and atomics of ringbell's RC QPs. Prints "rma ok: N ranks" on rank 0 when all agree. */
#include <mpi.h>
#include <stdio.h>

int main(int argc, char **argv)
{
	MPI_Init(&argc, &argv);
	int r, n;
	MPI_Comm_rank(MPI_COMM_WORLD, &r);
	MPI_Comm_size(MPI_COMM_WORLD, &n);
	long *buf;
	MPI_Win win;
	MPI_Win_allocate(1024 * sizeof(long), sizeof(long), MPI_INFO_NULL, MPI_COMM_WORLD, &buf,
			 &win);
	for (int i = 0; i < 1024; i++)
		buf[i] = -1;
	int right = (r + 1) % n, left = (r + n - 1) % n, bad = 0;

	/* Put to the right, read back what the left put here, then get from the right. */
	MPI_Win_fence(0, win);
	long v[16], g[16];
	for (int i = 0; i < 16; i++)
		v[i] = r * 100 + i;
	MPI_Put(v, 16, MPI_LONG, right, 0, 16, MPI_LONG, win);
	MPI_Win_fence(0, win);
	for (int i = 0; i < 16; i++)
		bad += buf[i] != left * 100 + i;
	MPI_Get(g, 16, MPI_LONG, right, 0, 16, MPI_LONG, win);
	MPI_Win_fence(MPI_MODE_NOSUCCEED, win);
	for (int i = 0; i < 16; i++)
		bad += g[i] != r * 100 + i;

	/* Atomics under a shared lock on rank 0's word 100. */
	long one = r + 1, old = 0, total = 0;
	MPI_Win_lock(MPI_LOCK_SHARED, 0, 0, win);
	MPI_Fetch_and_op(&one, &old, MPI_LONG, 0, 100, MPI_SUM, win);
	MPI_Win_unlock(0, win);
	MPI_Barrier(MPI_COMM_WORLD);
	MPI_Win_lock(MPI_LOCK_SHARED, 0, 0, win);
	MPI_Get(&total, 1, MPI_LONG, 0, 100, 1, MPI_LONG, win);
	MPI_Win_unlock(0, win);
	long want = -1 + (long)n * (n + 1) / 2;
	bad += total != want;
	bad += old < -1 || old >= want;

	/* Accumulate into the right neighbour's word 200. */
	MPI_Win_fence(MPI_MODE_NOPRECEDE, win);
	MPI_Accumulate(&one, 1, MPI_LONG, right, 200, 1, MPI_LONG, MPI_SUM, win);
	MPI_Win_fence(MPI_MODE_NOSUCCEED, win);
	bad += buf[200] != -1 + left + 1;

	int all = 0;
	MPI_Allreduce(&bad, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
	if (r == 0)
		printf("rma %s: %d ranks, fetch-and-add total %ld (want %ld), %d wrong\n",
		       all ? "FAILED" : "ok", n, total, want, all);
	MPI_Win_free(&win);
	MPI_Finalize();
	return all != 0;
}
