# Homebrew formula template. Fill in url and sha256 for a release's sdist
# (packaging/build-dist.sh builds it; `shasum -a 256 dist/meshnode-VERSION.tar.gz`), then
# `brew update-python-resources meshnode` adds a resource block per dependency.
class Meshnode < Formula
  include Language::Python::Virtualenv

  desc "Pool the computers on a LAN into one LLM server"
  homepage "https://example.invalid/meshnode"   # the project's page
  url "https://example.invalid/meshnode-VERSION.tar.gz"
  sha256 "SHA256_OF_THE_SDIST"
  license "MIT"

  depends_on "cmake" => :build                  # llama-cpp-python builds llama.cpp
  depends_on "python@3.12"

  # resource "..." do ... end                   # from brew update-python-resources

  def install
    virtualenv_install_with_resources
  end

  service do
    run [opt_bin/"meshnode", "serve", "--headless"]
    keep_alive successful_exit: false
    log_path var/"log/meshnode.log"
    error_log_path var/"log/meshnode.log"
  end

  test do
    assert_match version.to_s, shell_output("#{bin}/meshnode --version")
  end
end
