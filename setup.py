"""Builds the crop decoder ``trainer/libcropjpeg.so`` (csrc/cropjpeg.c against the system's
libjpeg-turbo) with the package, so a plain ``pip install`` decodes only the crops, as
``scripts/build-native.sh`` does for a checkout. It is a C library loaded with ctypes
(``trainer.data.cropdecode``), not a Python extension, so it keeps that name. Optional: without
a C compiler or libjpeg's headers (Debian: libjpeg62-turbo-dev) the install goes on and the
loader decodes whole frames with PIL, saying so in one log line. Everything else is in
pyproject.toml."""
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CROPJPEG = "trainer.libcropjpeg"


class BuildCropJpeg(build_ext):
    def get_ext_filename(self, fullname: str) -> str:
        if fullname.split(".")[-1] == "libcropjpeg":  # asked with the last part of the name, or all of it
            return fullname.replace(".", "/") + ".so"
        return super().get_ext_filename(fullname)

    def get_export_symbols(self, ext):  # a plain C library: no PyInit_ function to export
        return ext.export_symbols


setup(ext_modules=[Extension(CROPJPEG, ["csrc/cropjpeg.c"], libraries=["jpeg"], optional=True,
                             extra_compile_args=["-O2"])],
      cmdclass={"build_ext": BuildCropJpeg})
