"""The test suite, laid out as the package: tests/<layer>/test_<module>.py for predictor_training/<layer>/<module>.py;
end-to-end runs of the entry scripts in tests/recipes/ (train_predictor_*.py, fvtools/) and tests/tools/ (tools/,
benchmarks/); shared builders and torchrun workers in tests/helpers/; the golden conformance vectors ship with the
package, in predictor_training/conformance/golden/. Every folder is a package, so that test files of different folders may share a
name."""
