/* Hostile calls into libmirrorsd's C ABI, one case per process: NULL pointers, numbers out of range, re-entry from
 * the token callback, and a model used after (or while) it is closed. Written in C, so the header is checked as C.
 *
 *   mirrorsd_hostile --list                    the case names, one a line
 *   mirrorsd_hostile EXPORT_FOLDER CASE        run one case
 *
 * A case that must fail prints "error: <mirrorsd_last_error()>" on stderr and exits with the status it got (1..8). A
 * case that must succeed prints "ok: ..." on stdout and exits 0. A wrong answer (success where an error is due, an
 * error without text, an error where success is due) prints "wrong: ..." and exits 100; 64 is bad usage. A crash or
 * a hang is the caller's to see: run it as a child process with a timeout (tests/catalogue_native.py does).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mirrorsd.h"

#if MIRRORSD_ABI_VERSION >= 3
#define CLOSE(model) mirrorsd_close(model)
#else /* ABI 2's close returned nothing (for the "before" column of docs/reliability.md) */
static mirrorsd_status close_void(mirrorsd_model* model) {
  mirrorsd_close(model);
  return MIRRORSD_OK;
}
#define CLOSE(model) close_void(model)
#define on_draft_failure fallback_on_draft_failure /* ABI 3 took the Python runtime's name */
#endif

typedef struct outcome {
  int status;
  char text[4096];
} outcome;

static const char* g_folder;
static const int64_t g_prompt[] = {1, 17, 42};

static outcome observe(int status) {
  outcome o;
  o.status = status;
  snprintf(o.text, sizeof o.text, "%s", mirrorsd_last_error());
  return o;
}

static int32_t keep_going(int64_t token, void* user) {
  (void)token;
  (void)user;
  return 0;
}

static mirrorsd_model* open_model(void) {
  mirrorsd_model* model = NULL;
  if (mirrorsd_open(g_folder, NULL, &model) != MIRRORSD_OK) {
    fprintf(stderr, "wrong: the export does not open: %s\n", mirrorsd_last_error());
    exit(100);
  }
  return model;
}

static mirrorsd_generate_config config_of(int mode) {
  mirrorsd_generate_config config;
  mirrorsd_generate_config_init(&config);
  config.mode = mode;
  config.max_new_tokens = 6;
  return config;
}

static outcome generate_with(mirrorsd_model* model, const mirrorsd_generate_config* config) {
  return observe(mirrorsd_generate(model, g_prompt, 3, config, keep_going, NULL, NULL));
}

/* ---- NULL pointers ------------------------------------------------------------------------------------------ */
static outcome open_null_folder(void) {
  mirrorsd_model* model = NULL;
  return observe(mirrorsd_open(NULL, NULL, &model));
}

static outcome open_folder(void) { /* a folder that is no export: what does the fix say? */
  mirrorsd_model* model = NULL;
  outcome o = observe(mirrorsd_open(g_folder, NULL, &model));
  CLOSE(model);
  return o;
}

static outcome open_null_model(void) { return observe(mirrorsd_open(g_folder, NULL, NULL)); }

static outcome info_null_model(void) {
  mirrorsd_model_info info;
  info.struct_size = sizeof info;
  return observe(mirrorsd_model_get_info(NULL, &info));
}

static outcome info_null_info(void) {
  mirrorsd_model* model = open_model();
  outcome o = observe(mirrorsd_model_get_info(model, NULL));
  CLOSE(model);
  return o;
}

static outcome generate_null_model(void) {
  mirrorsd_generate_config config = config_of(MIRRORSD_MODE_MIRROR);
  return generate_with(NULL, &config);
}

static outcome generate_null_prompt(void) {
  mirrorsd_model* model = open_model();
  mirrorsd_generate_config config = config_of(MIRRORSD_MODE_MIRROR);
  outcome o = observe(mirrorsd_generate(model, NULL, 3, &config, keep_going, NULL, NULL));
  CLOSE(model);
  return o;
}

static outcome generate_null_config(void) {
  mirrorsd_model* model = open_model();
  outcome o = generate_with(model, NULL);
  CLOSE(model);
  return o;
}

static outcome generate_null_callback(void) {
  mirrorsd_model* model = open_model();
  mirrorsd_generate_config config = config_of(MIRRORSD_MODE_MIRROR);
  outcome o = observe(mirrorsd_generate(model, g_prompt, 3, &config, NULL, NULL, NULL));
  CLOSE(model);
  return o;
}

static outcome close_null(void) {
  mirrorsd_open_options_init(NULL); /* the init functions ignore NULL */
  mirrorsd_generate_config_init(NULL);
  return observe(CLOSE(NULL));
}

/* ---- numbers out of range ----------------------------------------------------------------------------------- */
static outcome open_threads(int32_t target, int32_t draft) {
  mirrorsd_open_options options;
  mirrorsd_open_options_init(&options);
  options.target_threads = target;
  options.draft_threads = draft;
  mirrorsd_model* model = NULL;
  outcome o = observe(mirrorsd_open(g_folder, &options, &model));
  CLOSE(model);
  return o;
}

static outcome target_threads_1e6(void) { return open_threads(1000000, 0); }
static outcome draft_threads_negative(void) { return open_threads(0, -3); }

enum field { MAX_NEW_TOKENS, GAMMA, BRANCHES, BRANCH_BATCH, RUNNER_UP_K, MODE, BUDGET, EXIT_HEAD, FALLBACK };

static outcome generate_set(int mode, enum field which, int32_t value) {
  mirrorsd_model* model = open_model();
  mirrorsd_generate_config config = config_of(mode);
  int32_t* fields[] = {&config.max_new_tokens, &config.gamma, &config.branches, &config.branch_batch,
                       &config.runner_up_k, &config.mode, &config.branch_budget, &config.exit_head,
                       &config.on_draft_failure};
  *fields[which] = value;
  outcome o = generate_with(model, &config);
  CLOSE(model);
  return o;
}

static outcome max_new_tokens_0(void) { return generate_set(MIRRORSD_MODE_AR, MAX_NEW_TOKENS, 0); }
static outcome max_new_tokens_negative(void) { return generate_set(MIRRORSD_MODE_AR, MAX_NEW_TOKENS, -5); }
static outcome gamma_0(void) { return generate_set(MIRRORSD_MODE_SD, GAMMA, 0); }
static outcome gamma_int_max(void) { return generate_set(MIRRORSD_MODE_SD, GAMMA, INT32_MAX); }
static outcome branches_0(void) { return generate_set(MIRRORSD_MODE_MIRROR, BRANCHES, 0); }
static outcome branch_batch_negative(void) { return generate_set(MIRRORSD_MODE_MIRROR, BRANCH_BATCH, -1); }
static outcome runner_up_k_int_max(void) { return generate_set(MIRRORSD_MODE_MIRROR, RUNNER_UP_K, INT32_MAX); }
static outcome mode_99(void) { return generate_set(MIRRORSD_MODE_AR, MODE, 99); }
static outcome budget_negative(void) { return generate_set(MIRRORSD_MODE_MIRROR, BUDGET, -1); }
static outcome exit_head_2(void) { return generate_set(MIRRORSD_MODE_MIRROR, EXIT_HEAD, 2); }
static outcome fallback_7(void) { return generate_set(MIRRORSD_MODE_SD, FALLBACK, 7); }

static outcome generate_timeout(double seconds) {
  mirrorsd_model* model = open_model();
  mirrorsd_generate_config config = config_of(MIRRORSD_MODE_MIRROR);
  config.draft_timeout_s = seconds;
  outcome o = generate_with(model, &config);
  CLOSE(model);
  return o;
}

static outcome timeout_nan(void) { return generate_timeout(NAN); }
static outcome timeout_0(void) { return generate_timeout(0.0); }
static outcome timeout_negative(void) { return generate_timeout(-1.0); }
static outcome timeout_1e300(void) { return generate_timeout(1e300); } /* "never": must decode */
static outcome timeout_infinity(void) { return generate_timeout(INFINITY); }

static outcome prompt_length_negative(void) {
  mirrorsd_model* model = open_model();
  mirrorsd_generate_config config = config_of(MIRRORSD_MODE_AR);
  outcome o = observe(mirrorsd_generate(model, g_prompt, -1, &config, keep_going, NULL, NULL));
  CLOSE(model);
  return o;
}

static outcome prompt_id_out_of_range(void) {
  mirrorsd_model* model = open_model();
  mirrorsd_generate_config config = config_of(MIRRORSD_MODE_AR);
  const int64_t prompt[] = {1, INT64_MAX};
  outcome o = observe(mirrorsd_generate(model, prompt, 2, &config, keep_going, NULL, NULL));
  CLOSE(model);
  return o;
}

static outcome config_struct_size_0(void) {
  mirrorsd_model* model = open_model();
  mirrorsd_generate_config config = config_of(MIRRORSD_MODE_AR);
  config.struct_size = 0;
  outcome o = generate_with(model, &config);
  CLOSE(model);
  return o;
}

/* ---- re-entry from on_token --------------------------------------------------------------------------------- */
typedef struct reentry {
  mirrorsd_model* model; /* the model the callback calls into */
  int close;             /* 1: mirrorsd_close, 0: mirrorsd_generate */
  int called;
  outcome inner;
} reentry;

static int32_t reenter(int64_t token, void* user) {
  reentry* r = (reentry*)user;
  (void)token;
  if (!r->called) {
    r->called = 1;
    if (r->close) {
      r->inner = observe(CLOSE(r->model));
    } else {
      mirrorsd_generate_config config = config_of(MIRRORSD_MODE_AR);
      r->inner = observe(mirrorsd_generate(r->model, g_prompt, 3, &config, keep_going, NULL, NULL));
    }
  }
  return 0;
}

/* Generate with `model`; the callback calls into `target` once. The outer generation must still succeed. */
static outcome reentry_case(int mode, int close, int other_model) {
  mirrorsd_model* model = open_model();
  mirrorsd_model* other = other_model ? open_model() : NULL;
  reentry r = {other_model ? other : model, close, 0, {0, ""}};
  mirrorsd_generate_config config = config_of(mode);
  outcome outer = observe(mirrorsd_generate(model, g_prompt, 3, &config, reenter, &r, NULL));
  if (outer.status != MIRRORSD_OK) {
    snprintf(r.inner.text, sizeof r.inner.text, "the outer generation failed (%d): %.3000s", outer.status, outer.text);
    r.inner.status = 100;
  }
  if (!(close && r.inner.status == MIRRORSD_OK)) CLOSE(model); /* a close that succeeded inside already freed it */
  if (other != NULL) CLOSE(other);
  return r.inner;
}

static outcome reenter_generate_mirror(void) { return reentry_case(MIRRORSD_MODE_MIRROR, 0, 0); }
static outcome reenter_generate_ar(void) { return reentry_case(MIRRORSD_MODE_AR, 0, 0); }
static outcome reenter_close_mirror(void) { return reentry_case(MIRRORSD_MODE_MIRROR, 1, 0); }
static outcome callback_generates_other_model(void) { return reentry_case(MIRRORSD_MODE_MIRROR, 0, 1); }

/* ---- use after close ---------------------------------------------------------------------------------------- */
static outcome generate_after_close(void) {
  mirrorsd_model* model = open_model();
  CLOSE(model);
  mirrorsd_generate_config config = config_of(MIRRORSD_MODE_MIRROR);
  return generate_with(model, &config);
}

static outcome info_after_close(void) {
  mirrorsd_model* model = open_model();
  CLOSE(model);
  mirrorsd_model_info info;
  info.struct_size = sizeof info;
  return observe(mirrorsd_model_get_info(model, &info));
}

static outcome double_close(void) {
  mirrorsd_model* model = open_model();
  CLOSE(model);
  return observe(CLOSE(model));
}

static outcome made_up_handle(void) {
  char not_a_model[64] = {0};
  mirrorsd_generate_config config = config_of(MIRRORSD_MODE_AR);
  return generate_with((mirrorsd_model*)(void*)not_a_model, &config);
}

/* Thread A generates and, at its first token, waits until the main thread has tried to close the model. */
typedef struct racing {
  mirrorsd_model* model;
  pthread_mutex_t lock;
  pthread_cond_t changed;
  int inside, tried;
  outcome generated;
} racing;

static int32_t wait_for_close(int64_t token, void* user) {
  racing* r = (racing*)user;
  (void)token;
  pthread_mutex_lock(&r->lock);
  r->inside = 1;
  pthread_cond_broadcast(&r->changed);
  while (!r->tried) pthread_cond_wait(&r->changed, &r->lock);
  pthread_mutex_unlock(&r->lock);
  return 0;
}

static void* generate_thread(void* user) {
  racing* r = (racing*)user;
  mirrorsd_generate_config config = config_of(MIRRORSD_MODE_MIRROR);
  r->generated = observe(mirrorsd_generate(r->model, g_prompt, 3, &config, wait_for_close, r, NULL));
  return NULL;
}

static outcome close_during_generate(void) {
  racing r;
  memset(&r, 0, sizeof r);
  r.model = open_model();
  pthread_mutex_init(&r.lock, NULL);
  pthread_cond_init(&r.changed, NULL);
  pthread_t thread;
  pthread_create(&thread, NULL, generate_thread, &r);
  pthread_mutex_lock(&r.lock);
  while (!r.inside) pthread_cond_wait(&r.changed, &r.lock);
  pthread_mutex_unlock(&r.lock);
  outcome closed = observe(CLOSE(r.model)); /* the other thread is inside mirrorsd_generate */
  pthread_mutex_lock(&r.lock);
  r.tried = 1;
  pthread_cond_broadcast(&r.changed);
  pthread_mutex_unlock(&r.lock);
  pthread_join(thread, NULL);
  if (r.generated.status != MIRRORSD_OK) {
    snprintf(closed.text, sizeof closed.text, "the generation failed (%d): %.3000s", r.generated.status,
             r.generated.text);
    closed.status = 100;
  } else if (closed.status != MIRRORSD_OK) {
    outcome after = observe(CLOSE(r.model)); /* refused while busy: it closes once the generation is over */
    if (after.status != MIRRORSD_OK) {
      snprintf(closed.text, sizeof closed.text, "closing after the generation failed (%d): %.3000s", after.status,
               after.text);
      closed.status = 100;
    }
  }
  return closed;
}

/* ---- the table ---------------------------------------------------------------------------------------------- */
typedef struct hostile_case {
  const char* name;
  outcome (*run)(void);
  int must_fail;
} hostile_case;

static const hostile_case kCases[] = {
    {"open-folder", open_folder, 1},
    {"open-null-folder", open_null_folder, 1},
    {"open-null-model", open_null_model, 1},
    {"info-null-model", info_null_model, 1},
    {"info-null-info", info_null_info, 1},
    {"generate-null-model", generate_null_model, 1},
    {"generate-null-prompt", generate_null_prompt, 1},
    {"generate-null-config", generate_null_config, 1},
    {"generate-null-callback", generate_null_callback, 1},
    {"close-null", close_null, 0},
    {"target-threads-1e6", target_threads_1e6, 1},
    {"draft-threads-negative", draft_threads_negative, 1},
    {"max-new-tokens-0", max_new_tokens_0, 1},
    {"max-new-tokens-negative", max_new_tokens_negative, 1},
    {"gamma-0", gamma_0, 1},
    {"gamma-int-max", gamma_int_max, 1},
    {"branches-0", branches_0, 1},
    {"branch-batch-negative", branch_batch_negative, 1},
    {"runner-up-k-int-max", runner_up_k_int_max, 1},
    {"mode-99", mode_99, 1},
    {"branch-budget-negative", budget_negative, 1},
    {"exit-head-2", exit_head_2, 1},
    {"fallback-7", fallback_7, 1},
    {"timeout-nan", timeout_nan, 1},
    {"timeout-0", timeout_0, 1},
    {"timeout-negative", timeout_negative, 1},
    {"timeout-1e300", timeout_1e300, 0},
    {"timeout-infinity", timeout_infinity, 0},
    {"prompt-length-negative", prompt_length_negative, 1},
    {"prompt-id-out-of-range", prompt_id_out_of_range, 1},
    {"config-struct-size-0", config_struct_size_0, 1},
    {"reenter-generate-mirror", reenter_generate_mirror, 1},
    {"reenter-generate-ar", reenter_generate_ar, 1},
    {"reenter-close-mirror", reenter_close_mirror, 1},
    {"callback-generates-other-model", callback_generates_other_model, 0},
    {"generate-after-close", generate_after_close, 1},
    {"info-after-close", info_after_close, 1},
    {"double-close", double_close, 1},
    {"made-up-handle", made_up_handle, 1},
    {"close-during-generate", close_during_generate, 1},
};

int main(int argc, char** argv) {
  const size_t count = sizeof kCases / sizeof kCases[0];
  if (argc == 2 && strcmp(argv[1], "--list") == 0) {
    for (size_t i = 0; i < count; ++i) puts(kCases[i].name);
    return 0;
  }
  if (argc != 3) {
    fputs("usage: mirrorsd_hostile --list | EXPORT_FOLDER CASE\n", stderr);
    return 64;
  }
  g_folder = argv[1];
  for (size_t i = 0; i < count; ++i) {
    if (strcmp(argv[2], kCases[i].name) != 0) continue;
    const outcome o = kCases[i].run();
    if (o.status == 100) {
      fprintf(stderr, "wrong: %s\n", o.text);
      return 100;
    }
    if (kCases[i].must_fail) {
      if (o.status == MIRRORSD_OK) {
        fputs("wrong: the library returned MIRRORSD_OK\n", stderr);
        return 100;
      }
      if (o.text[0] == '\0') {
        fprintf(stderr, "wrong: status %d without text\n", o.status);
        return 100;
      }
      fprintf(stderr, "error: %s\n", o.text);
      return o.status;
    }
    if (o.status != MIRRORSD_OK) {
      fprintf(stderr, "wrong: status %d: %s\n", o.status, o.text);
      return 100;
    }
    printf("ok: %s\n", argv[2]);
    return 0;
  }
  fprintf(stderr, "unknown case '%s' (--list names them)\n", argv[2]);
  return 64;
}
