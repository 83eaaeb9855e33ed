/* hostaddr.c: two processes on a served fabric that know nothing of each other but this
 * host's address and a service number, as fabtests' programs do when runfabtests.sh runs
 * them without an out-of-band exchange.
 *
 *   hostaddr server SERVICE   fi_getinfo(NULL, SERVICE, FI_SOURCE): its endpoint takes the
 *                             number; receives the client's name, answers "pong" to it.
 *   hostaddr client SERVICE   fi_getinfo("127.0.0.1", SERVICE, 0): sends its own name to
 *                             the address that gives, then expects "pong".
 *
 * Each process claims its own NIC (RINGBELL_NIC or the lock files). */
#include "ctest.h"

/* One process's side: the pair helpers of ctest.h with this process's own fabric. */
static struct ct_pair P;
static const struct ct_opts O = {.caps = FI_MSG};

static void open_side(struct ct_side *s)
{
	MUST(fi_fabric(s->info->fabric_attr, &P.fab, NULL));
	ct_side_open(&P, s, s->info, &O);
}

static void close_side(struct ct_side *s)
{
	ct_side_close(s);
	CHECK_EQ(fi_close(&P.fab->fid), 0);
	fi_freeinfo(s->info);
}

static void server(const char *service)
{
	struct ct_side s = {0};
	struct fi_info *h = ct_hints(FI_MSG, 0);
	MUST(fi_getinfo(CT_VERSION, NULL, service, FI_SOURCE, h, &s.info));
	fi_freeinfo(h);
	open_side(&s);
	char *buf = ct_pages(4096);
	struct fi_cq_tagged_entry e;
	MUST(fi_recv(s.ep, buf, 64, NULL, FI_ADDR_UNSPEC, buf));
	printf("listening\n");
	fflush(stdout);
	REQUIRE(ct_wait(s.cq, &e));
	CHECK(e.op_context == buf);
	CHECK_EQ(e.len, s.namelen);
	/* The client's own address, as it sent it: the answer goes there. */
	fi_addr_t client;
	CHECK_EQ(fi_av_insert(s.av, buf, 1, &client, 0, NULL), 1);
	strcpy(buf + 1024, "pong");
	MUST(fi_send(s.ep, buf + 1024, 5, NULL, client, buf + 1024));
	REQUIRE(ct_wait(s.cq, &e));
	CHECK(e.op_context == buf + 1024);
	close_side(&s);
}

static void client(const char *service)
{
	struct ct_side c = {0};
	struct fi_info *h = ct_hints(FI_MSG, 0);
	MUST(fi_getinfo(CT_VERSION, "127.0.0.1", service, 0, h, &c.info));
	fi_freeinfo(h);
	REQUIRE(c.info->dest_addr != NULL);
	open_side(&c);
	fi_addr_t srv;
	CHECK_EQ(fi_av_insert(c.av, c.info->dest_addr, 1, &srv, 0, NULL), 1);
	char *buf = ct_pages(4096);
	struct fi_cq_tagged_entry e;
	MUST(fi_recv(c.ep, buf, 64, NULL, FI_ADDR_UNSPEC, buf));
	memcpy(buf + 1024, c.name, c.namelen);
	MUST(fi_send(c.ep, buf + 1024, c.namelen, NULL, srv, buf + 1024));
	/* The send's completion and the answer, in either order. */
	for (int i = 0; i < 2; i++) {
		REQUIRE(ct_wait(c.cq, &e));
		if (e.op_context == buf) {
			CHECK_EQ(e.len, 5);
			CHECK(strcmp(buf, "pong") == 0);
		} else {
			CHECK(e.op_context == buf + 1024);
		}
	}
	close_side(&c);
}

int main(int argc, char **argv)
{
	if (argc != 3 || (strcmp(argv[1], "server") && strcmp(argv[1], "client"))) {
		fprintf(stderr, "usage: hostaddr server|client SERVICE\n");
		return 2;
	}
	if (strcmp(argv[1], "server") == 0)
		server(argv[2]);
	else
		client(argv[2]);
	ct_name = argv[1];
	return ct_summary_exit();
}
