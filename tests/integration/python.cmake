# Python suites that check the coordinator against an independent gRPC implementation (grpcio):
# health, reflection, reflected message classes, bad input, Watch, the store, TLS and mTLS.
# They run in a virtual environment that the venv_setup fixture makes with scripts/test-venv.sh.
set(PSHARD_TEST_VENV ${CMAKE_BINARY_DIR}/venv)

add_test(NAME venv_setup
         COMMAND bash ${PROJECT_SOURCE_DIR}/scripts/test-venv.sh ${PSHARD_TEST_VENV})
set_tests_properties(venv_setup PROPERTIES FIXTURES_SETUP venv LABELS integration TIMEOUT 600)

add_test(NAME interop_grpcio
         COMMAND ${PSHARD_TEST_VENV}/bin/python ${CMAKE_CURRENT_SOURCE_DIR}/interop_grpcio.py
                 $<TARGET_FILE:pshard-coordinator>)
add_test(NAME tls
         COMMAND ${PSHARD_TEST_VENV}/bin/python ${CMAKE_CURRENT_SOURCE_DIR}/tls_test.py
                 $<TARGET_FILE:pshard-coordinator>)
set_tests_properties(interop_grpcio tls PROPERTIES FIXTURES_REQUIRED venv LABELS integration
                     TIMEOUT 300 ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")

# /metrics of the coordinator and the shard servers, parsed by PyPI's prometheus_client.
add_test(NAME metrics
         COMMAND ${PSHARD_TEST_VENV}/bin/python ${CMAKE_CURRENT_SOURCE_DIR}/metrics_test.py
                 $<TARGET_FILE:pshard-coordinator> $<TARGET_FILE:pshard-server>)
set_tests_properties(metrics PROPERTIES FIXTURES_REQUIRED venv LABELS integration TIMEOUT 300
                     ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
