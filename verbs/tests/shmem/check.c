/* OpenSHMEM on ringbell NICs (Open MPI's OSHMEM over UCX): each PE puts 1024 longs into its
 * right neighbour's symmetric buffer and gets them back, every PE adds to a counter on every
 * PE, then all fetch-and-add one counter. Every PE checks what it sees; PE 0 prints one
 * line on success. Exits non-zero with a message on the first mismatch. */
#include <shmem.h>
#include <stdio.h>

#define N 1024

int main(void)
{
	shmem_init();
	int me = shmem_my_pe(), n = shmem_n_pes();
	long *dst = shmem_malloc(N * sizeof(long));
	long *ctr = shmem_malloc(sizeof(long));
	long *tick = shmem_malloc(sizeof(long));
	if (!dst || !ctr || !tick) {
		printf("PE %d: shmem_malloc failed\n", me);
		return 1;
	}
	long src[N], got[N];
	*ctr = 0;
	*tick = 0;
	for (int i = 0; i < N; i++) {
		src[i] = me * 100000L + i;
		dst[i] = -1;
	}
	shmem_barrier_all();

	int right = (me + 1) % n, left = (me + n - 1) % n;
	shmem_long_put(dst, src, N, right);
	shmem_barrier_all();
	for (int i = 0; i < N; i++)
		if (dst[i] != left * 100000L + i) {
			printf("PE %d: after put dst[%d] = %ld\n", me, i, dst[i]);
			return 1;
		}
	shmem_long_get(got, dst, N, right);
	for (int i = 0; i < N; i++)
		if (got[i] != me * 100000L + i) {
			printf("PE %d: get got[%d] = %ld\n", me, i, got[i]);
			return 1;
		}

	for (int p = 0; p < n; p++)
		shmem_long_atomic_add(ctr, me + 1, p);
	shmem_barrier_all();
	long want = (long)n * (n + 1) / 2;
	if (*ctr != want) {
		printf("PE %d: counter %ld, want %ld\n", me, *ctr, want);
		return 1;
	}

	/* Every PE takes a distinct ticket from PE 0's counter. */
	long mine = shmem_long_atomic_fetch_add(tick, 1, 0);
	if (mine < 0 || mine >= n) {
		printf("PE %d: ticket %ld of %d\n", me, mine, n);
		return 1;
	}
	shmem_barrier_all();
	if (me == 0 && *tick != n) {
		printf("PE 0: %ld tickets taken, want %d\n", *tick, n);
		return 1;
	}
	if (me == 0)
		printf("shmem ok: %d PEs, %d-long put and get around the ring, atomic adds to %ld on "
		       "every PE, %d fetch-add tickets\n",
		       n, N, want, n);
	shmem_free(tick);
	shmem_free(ctr);
	shmem_free(dst);
	shmem_finalize();
	return 0;
}
