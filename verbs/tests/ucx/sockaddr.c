/*
 * A UCP client and server that meet at a socket address: UCX's connection managers
 * (its rdmacm one, over the library's RDMA-CM, on ringbell NICs), then streams over the
 * transports they agree on. `sockaddr -s IP` listens on IP:PORT and prints "listening";
 * `sockaddr -c IP` connects. The client sends ROUNDS messages of SIZE bytes, each of
 * which the server checks and answers with 8 bytes the client checks. Exit 0 when all
 * went through.
 */
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucp/api/ucp.h>

#define PORT 13337
#define ROUNDS 100
#define SIZE 4096

static ucp_conn_request_h incoming;

static void on_request(ucp_conn_request_h r, void *arg)
{
	(void)arg;
	incoming = r;
}

static void on_error(void *arg, ucp_ep_h ep, ucs_status_t st)
{
	(void)arg;
	(void)ep;
	fprintf(stderr, "endpoint error: %s\n", ucs_status_string(st));
	exit(1);
}

static void sent(void *req, ucs_status_t st, void *user)
{
	(void)req;
	*(ucs_status_t *)user = st;
}

static void received(void *req, ucs_status_t st, size_t len, void *user)
{
	(void)req;
	(void)len;
	*(ucs_status_t *)user = st;
}

/* Waits for request `req` (NULL: done at once); exits on an error. */
static void finish(ucp_worker_h w, void *req, const char *what)
{
	if (UCS_PTR_IS_ERR(req)) {
		fprintf(stderr, "%s: %s\n", what, ucs_status_string(UCS_PTR_STATUS(req)));
		exit(1);
	}
	if (req == NULL)
		return;
	ucs_status_t st;
	while ((st = ucp_request_check_status(req)) == UCS_INPROGRESS)
		ucp_worker_progress(w);
	ucp_request_free(req);
	if (st != UCS_OK) {
		fprintf(stderr, "%s: %s\n", what, ucs_status_string(st));
		exit(1);
	}
}

static void send_all(ucp_worker_h w, ucp_ep_h ep, const char *buf, size_t len)
{
	ucs_status_t st = UCS_OK;
	ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
						 UCP_OP_ATTR_FIELD_USER_DATA,
				 .cb.send = sent,
				 .user_data = &st};
	finish(w, ucp_stream_send_nbx(ep, buf, len, &p), "send");
}

/* Receives exactly `len` bytes (a stream receive may return fewer). */
static void recv_all(ucp_worker_h w, ucp_ep_h ep, char *buf, size_t len)
{
	size_t got = 0;
	while (got < len) {
		size_t n = 0;
		ucs_status_t st = UCS_OK;
		ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
							 UCP_OP_ATTR_FIELD_USER_DATA |
							 UCP_OP_ATTR_FIELD_FLAGS,
					 .flags = UCP_STREAM_RECV_FLAG_WAITALL,
					 .cb.recv_stream = received,
					 .user_data = &st};
		void *r = ucp_stream_recv_nbx(ep, buf + got, len - got, &n, &p);
		if (r != NULL && !UCS_PTR_IS_ERR(r))
			n = len - got; /* WAITALL: a request completes with all of it */
		finish(w, r, "receive");
		got += n;
	}
}

static char byte(int round, size_t i)
{
	return (char)(round * 7 + i * 13 + (i >> 8));
}

int main(int argc, char **argv)
{
	if (argc != 3 || (strcmp(argv[1], "-s") && strcmp(argv[1], "-c"))) {
		fprintf(stderr, "usage: %s -s|-c IP\n", argv[0]);
		return 2;
	}
	int server = !strcmp(argv[1], "-s");
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(PORT)};
	if (inet_pton(AF_INET, argv[2], &a.sin_addr) != 1) {
		fprintf(stderr, "not an IPv4 address: %s\n", argv[2]);
		return 2;
	}
	ucp_params_t params = {.field_mask = UCP_PARAM_FIELD_FEATURES,
			       .features = UCP_FEATURE_STREAM};
	ucp_context_h ctx;
	ucp_worker_h w;
	ucs_status_t st = ucp_init(&params, NULL, &ctx);
	if (st != UCS_OK) {
		fprintf(stderr, "ucp_init: %s\n", ucs_status_string(st));
		return 1;
	}
	ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
				  .thread_mode = UCS_THREAD_MODE_SINGLE};
	st = ucp_worker_create(ctx, &wp, &w);
	if (st != UCS_OK) {
		fprintf(stderr, "ucp_worker_create: %s\n", ucs_status_string(st));
		return 1;
	}
	ucp_ep_params_t ep_params = {
		.field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
		.err_mode = UCP_ERR_HANDLING_MODE_PEER,
		.err_handler = {.cb = on_error}};
	ucp_listener_h listener = NULL;
	if (server) {
		ucp_listener_params_t lp = {
			.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR |
				      UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
			.sockaddr = {.addr = (struct sockaddr *)&a, .addrlen = sizeof a},
			.conn_handler = {.cb = on_request}};
		st = ucp_listener_create(w, &lp, &listener);
		if (st != UCS_OK) {
			fprintf(stderr, "ucp_listener_create: %s\n", ucs_status_string(st));
			return 1;
		}
		printf("listening\n");
		fflush(stdout);
		while (incoming == NULL)
			ucp_worker_progress(w);
		ep_params.field_mask |= UCP_EP_PARAM_FIELD_CONN_REQUEST;
		ep_params.conn_request = incoming;
	} else {
		ep_params.field_mask |= UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
		ep_params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
		ep_params.sockaddr.addr = (struct sockaddr *)&a;
		ep_params.sockaddr.addrlen = sizeof a;
	}
	ucp_ep_h ep;
	st = ucp_ep_create(w, &ep_params, &ep);
	if (st != UCS_OK) {
		fprintf(stderr, "ucp_ep_create: %s\n", ucs_status_string(st));
		return 1;
	}
	static char buf[SIZE];
	for (int r = 0; r < ROUNDS; r++) {
		if (server) {
			recv_all(w, ep, buf, SIZE);
			for (size_t i = 0; i < SIZE; i++) {
				if (buf[i] != byte(r, i)) {
					fprintf(stderr, "round %d: byte %zu differs\n", r, i);
					return 1;
				}
			}
			for (size_t i = 0; i < 8; i++)
				buf[i] = byte(r + 1000, i);
			send_all(w, ep, buf, 8);
		} else {
			for (size_t i = 0; i < SIZE; i++)
				buf[i] = byte(r, i);
			send_all(w, ep, buf, SIZE);
			recv_all(w, ep, buf, 8);
			for (size_t i = 0; i < 8; i++) {
				if (buf[i] != byte(r + 1000, i)) {
					fprintf(stderr, "round %d: answer byte %zu differs\n", r, i);
					return 1;
				}
			}
		}
	}
	printf("%s: %d exchanges of %d bytes ok\n", server ? "server" : "client", ROUNDS, SIZE);
	fflush(stdout);
	ucp_request_param_t cp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
				  .flags = UCP_EP_CLOSE_FLAG_FORCE};
	void *req = ucp_ep_close_nbx(ep, &cp);
	if (req != NULL && !UCS_PTR_IS_ERR(req)) {
		while (ucp_request_check_status(req) == UCS_INPROGRESS)
			ucp_worker_progress(w);
		ucp_request_free(req);
	}
	if (listener != NULL)
		ucp_listener_destroy(listener);
	ucp_worker_destroy(w);
	ucp_cleanup(ctx);
	return 0;
}
