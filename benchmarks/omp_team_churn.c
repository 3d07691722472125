/* How many threads libgomp starts when parallel regions alternate between two team sizes: the count of
   distinct thread ids seen in the larger regions over ROUNDS rounds.  A pool that keeps its threads shows
   LARGE; one that ends the threads a smaller region leaves out shows about LARGE + ROUNDS * (LARGE - SMALL).

       gcc -O2 -fopenmp benchmarks/omp_team_churn.c -o /tmp/omp_team_churn && /tmp/omp_team_churn

   Prints one JSON line.  Why the forward's regions take the whole pool: docs/performance.md. */
#include <omp.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { LARGE = 8, SMALL = 4, ROUNDS = 50, MAX_IDS = 1 << 22 };

static unsigned char seen[MAX_IDS];

int main(void) {
    int distinct = 0;
    for (int round = 0; round < ROUNDS; ++round) {
#pragma omp parallel num_threads(LARGE)
        {
            const long id = syscall(SYS_gettid) % MAX_IDS;
#pragma omp critical
            if (!seen[id]) {
                seen[id] = 1;
                ++distinct;
            }
        }
#pragma omp parallel num_threads(SMALL)
        {
            volatile int idle = 0;
            (void)idle;
        }
    }
    printf("{\"bench\": \"omp_team_churn\", \"large\": %d, \"small\": %d, \"rounds\": %d, "
           "\"distinct_threads_in_large_regions\": %d}\n", LARGE, SMALL, ROUNDS, distinct);
    return 0;
}
